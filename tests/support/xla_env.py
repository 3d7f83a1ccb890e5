"""The XLA flags of every process the tests run: pytest's own (conftest.py) and the runs the
tests start as subprocesses.

Most of a test's time is compiling small CPU programs, and LLVM's optimisation of the code it
generates is most of that: without it (--xla_backend_optimization_level=0) the suite compiles
about twice as fast. The HLO programs stay the same, but the machine code does not: float results
can differ in the last bits (a tiny-moe run's entropy by 7e-7 relative), so a test comparing
against numbers committed from a default run (test_checkpoint_compat) runs without these flags.
Only the tiny models' steps run slower. Runs outside the tests keep XLA's defaults.
"""

FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test process, with `devices` simulated CPU devices if given."""
    count = f" --xla_force_host_platform_device_count={devices}" if devices else ""
    return FAST_COMPILE + count
