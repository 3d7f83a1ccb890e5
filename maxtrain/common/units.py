"""Numbers as the start-up lines, summaries and --list-models print them."""


def count(n: float) -> str:
    """1234567 -> '1.23M': three significant digits and a unit (K, M, B, T), rounded before
    the unit is chosen, so that 999,885,952 is '1B', not '1e+03M'."""
    rounded = float(f"{n:.3g}")
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if rounded >= size:
            return f"{rounded / size:.3g}{unit}"
    return str(int(n))
