"""What a plan says: each compiled candidate's verdict (a reduced-depth proxy's scaled to the
model's depth), the ranking among those the compiler says fit, the table, and the winner
written as a config overlay."""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from maxtrain.common import files
from maxtrain.common.devices import Chip
from maxtrain.planning.screening import Screened


@dataclass
class Outcome:
    """A compiled candidate: the compiler's verdict and the predicted step, or why none."""

    screened: Screened
    is_config: bool  # the layout the config states
    fits: bool = False
    step_s: float | None = None
    peak_gib: float | None = None
    bound: str = ""
    mfu: float | None = None
    source: str = ""  # compiled, cache, proxy of depths ... ; or why there is no verdict
    cached: bool = False  # every compile of it came from the plan cache


def at_depth(results: list[dict], depths: tuple[int, ...], layers: int, hbm_gib: float) -> dict:
    """One verdict for the model's `layers`: the compile's own, or a reduced-depth proxy's
    compiled at two depths, its step time, peak memory and each category's seconds scaled
    linearly in the layer count (a scanned stack's per-layer cost is the same in every layer:
    tests/planning/test_plan_compiles.py checks it against a full compile)."""
    if len(results) == 1:
        return results[0]
    (a, b), (d1, d2) = results, depths
    if not (a.get("fits") and b.get("fits")):
        return b if not b.get("fits") else a  # a proxy over the memory: the model is too
    line = lambda x, y: x + (y - x) * (layers - d1) / (d2 - d1)  # noqa: E731
    categories = {
        k: line(a["seconds_by_category"].get(k, 0.0), v)
        for k, v in b["seconds_by_category"].items()
    }
    peak = line(a["peak_gib"], b["peak_gib"])
    return {
        "fits": peak <= hbm_gib,
        "peak_gib": round(peak, 3),
        "step_s": line(a["step_s"], b["step_s"]),
        "bound": max(categories, key=categories.get) if categories else b["bound"],
    }


def outcome(screened: Screened, is_config: bool, verdict: dict, source: str, mfu_of) -> Outcome:
    """A candidate's row from its verdict (at_depth's) and `mfu_of(step_s)`."""
    out = Outcome(screened, is_config, source=source)
    if "skipped" in verdict or "failed" in verdict:
        out.source = verdict.get("skipped") or f"failed: {verdict['failed']}"
        return out
    if "refused" in verdict:
        out.source = "refused by the compiler"
        return out
    out.fits = bool(verdict["fits"])
    out.step_s, out.peak_gib, out.bound = verdict["step_s"], verdict["peak_gib"], verdict["bound"]
    out.mfu = mfu_of(out.step_s) if out.step_s else None
    return out


def ranked(outcomes: list[Outcome]) -> list[Outcome]:
    """Those the compiler says fit, fastest first, then the rest in the order compiled."""
    fit = sorted((o for o in outcomes if o.fits and o.step_s), key=lambda o: o.step_s)
    return fit + [o for o in outcomes if o not in fit]


def table(outcomes: list[Outcome], chip: Chip) -> str:
    """The plan's table, in Markdown: rank, layout, predicted step, MFU, compiled memory per
    chip, what bounds the step, the memory estimate and where the verdict came from."""
    rows = [
        "| # | layout | step (s) | MFU | memory/chip (GiB) | bound | estimate (GiB) | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rank, o in enumerate(outcomes, 1):
        step = f"{o.step_s:.4g}" if o.step_s else "-"
        mfu = f"{o.mfu:.1%}" if o.mfu else "-"
        peak = f"{o.peak_gib:.2f}" if o.peak_gib is not None else "-"
        verdict = o.source if o.fits else f"does not fit: {o.source}" if o.step_s else o.source
        label = o.screened.candidate.label() + (" (the config's)" if o.is_config else "")
        rows.append(
            f"| {rank if o.fits else '-'} | {label} | {step} | {mfu} | {peak} of "
            f"{chip.hbm_gib:g} | {o.bound or '-'} | {o.screened.estimate_gib:.2f} | {verdict} |"
        )
    return "\n".join(rows)


def write_overlay(path: str, winner: Outcome, command: str, chip: Chip) -> None:
    """The winner's keys as a YAML overlay: `python -m maxtrain.train CONFIG OVERLAY` runs it."""
    header = (
        f"# Written by: {command}\n"
        f"# The plan's winner on {chip.name}: a predicted step of {winner.step_s:.4g} s, MFU "
        f"{winner.mfu:.1%}, {winner.peak_gib:.2f} GiB per chip as compiled, bound by "
        f"{winner.bound}.\n"
        "# Use: python -m maxtrain.train CONFIG.yml THIS.yml (docs/planning.md)\n"
    )
    body = yaml.safe_dump(winner.screened.candidate.overlay(), sort_keys=False)
    files.write_atomic(path, header + body)
