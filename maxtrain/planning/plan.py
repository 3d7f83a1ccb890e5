"""Which layout for my slice: compiles the candidate layouts of a config's model and global
batch for a TPU topology (or NVIDIA GPUs) and ranks those the compiler says fit by their
predicted step time.

    python tools/plan.py CONFIG.yml --topology v5e:16x16 [--slices N] [key=value ...]
    python tools/plan.py CONFIG.yml --device h100 --devices 8 [key=value ...]

Candidates (candidates.py): every factorisation of the chips over the mesh axes the model can
use, within a slice and across slices, crossed with remat policies, micro-batch counts, the
pipeline's micro-batches, the expert exchange and the context exchange. Pruned by rules
(divisibility, heads per tensor shard, experts per device, dominated choices), then by the
memory estimate with its measured error as margin (screening.py). The config's own layout and
the `--compiles` survivors first in a first-order order are compiled (compiling.py: parallel
processes, a time budget, a cache), passing over a survivor when one of its kind with no larger
estimate did not fit (refused_alike); with --proxy a model of one layer kind as two reduced
depths whose step and memory scale to the model's layers (report.py). Prints the table and
writes the winner as a config overlay (`python -m maxtrain.train CONFIG.yml OVERLAY.yml`).
docs/planning.md says how, how long it takes and what the model leaves out.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

from maxtrain import config as config_lib
from maxtrain.common import devices as devices_lib
from maxtrain.common.errors import (
    ArgumentParser,
    UserError,
    non_negative_int,
    path_first,
    positive_int,
    refuse,
)
from maxtrain.config import Config
from maxtrain.parallel.topology import parse_topology
from maxtrain.planning import candidates as candidates_lib
from maxtrain.planning import compiling, report
from maxtrain.planning.screening import Screened, estimate_gib, screen, with_layout
from maxtrain.training import metrics

PASSED_OVER = "passed over"  # a candidate refused_alike rules out, which the table leaves out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    args.command = shlex.join(["python", "tools/plan.py", *argv])
    args.config, *args.overrides = path_first([args.config, *args.overrides])
    started = time.monotonic()
    try:
        cfg = config_lib.load(args.config, args.overrides)
        topology, chip, chips = _target(args)
        summary = plan(cfg, args, topology, chip, chips)
    except UserError as e:
        return refuse("plan", e)
    summary["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(summary))
    return 0


def _target(args) -> tuple[str, devices_lib.Chip, int]:
    """(the topology to compile for, its chip's row, chips per slice) from the flags."""
    if bool(args.topology) == bool(args.device):
        raise UserError("give --topology (a TPU slice, e.g. v5e:4x4) or --device h100 --devices N")
    if args.topology:
        generation, chips = parse_topology(args.topology)
        return args.topology, devices_lib.chip(f"tpu {generation}"), chips
    chip = devices_lib.chip(args.device)
    if (
        chip is None
        or chip.platform != "gpu"
        or args.device.lower() not in ("h100", "h200", "b200")
    ):
        raise UserError(f"--device {args.device!r}: expected h100, h200 or b200")
    return f"{args.device.lower()}:{args.devices}", devices_lib.chip(args.device), args.devices


def plan(cfg: Config, args, topology: str, chip: devices_lib.Chip, chips: int) -> dict:
    """The search (see the module docstring); returns the summary line's fields."""
    slices = args.slices or cfg.mesh.num_slices
    cfg = cfg.model_copy(update={"mesh": cfg.mesh.model_copy(update={"num_slices": slices})})
    baseline = candidates_lib.config_candidate(cfg, chips)
    if math.prod(baseline.dcn) != slices:  # --slices other than the config's: no baseline
        baseline = None
    considered, ruled = 0, Counter()
    survivors = []
    for c in candidates_lib.enumerate_candidates(cfg, chips, slices):
        considered += 1
        if why := candidates_lib.rule_out(cfg, c, chip.kinds[0], chips):
            ruled[why] += 1
        else:
            survivors.append(c)
    kept, dropped = screen(cfg, survivors, chip, chips)
    say(f"plan: {considered} candidates; {sum(ruled.values())} ruled out, "
        f"{sum(dropped.values())} dropped by the memory estimate, {len(kept)} left")  # fmt: skip
    chosen = [s for s in kept if s.candidate != baseline]
    if baseline:  # compiled first, whatever the estimate says: the layout to beat
        chosen.insert(0, Screened(baseline, estimate_gib(cfg, baseline, chip, chips), 0.0))
    outcomes, passed_over = _compile(cfg, args, chosen, topology, slices, chip, chips, baseline)
    ordered = report.ranked(outcomes)
    print(report.table(ordered, chip))
    winner = next((o for o in ordered if o.fits), None)
    if winner is not None:
        report.write_overlay(args.out, winner, args.command, chip)
    config_out = next((o for o in outcomes if o.is_config), None)
    return {
        "model": cfg.model_name,
        "topology": topology,
        "slices": slices,
        "candidates": considered,
        "ruled_out": dict(ruled.most_common()),
        "memory_dropped": dict(dropped.most_common()),
        "screened_in": len(kept),
        "compiled": len(outcomes),
        "passed_over": passed_over,
        "from_cache": sum(o.cached for o in outcomes),
        "winner": _row(winner),
        "config": _row(config_out),
        "overlay": args.out if winner else None,
    }


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _row(o: report.Outcome | None) -> dict | None:
    if o is None:
        return None
    return {"layout": o.screened.candidate.label(), "fits": o.fits, "step_s": o.step_s,
            "mfu": o.mfu and round(o.mfu, 4), "peak_gib": o.peak_gib, "bound": o.bound,
            "verdict": o.source}  # fmt: skip


def proxy_depths(cfg: Config, args) -> tuple[int, ...] | None:
    """With --proxy, two reduced depths to compile instead of the model's: one and two blocks
    of the pipeline's layers, for a stack of one layer kind (None: compile it whole)."""
    model, unit = cfg.model, cfg.pipeline.repeats
    if not args.proxy or model.mtp.depth or len(set(model.layer_types)) != 1:
        return None
    return (unit, 2 * unit)


def _compile(
    cfg, args, chosen: list[Screened], topology, slices, chip, chips, baseline
) -> tuple[list, int]:
    """Compiles the config's layout and `args.compiles` of the chosen candidates after it (two
    proxy depths each where proxy_depths says so), in order but for what refusals teach: a
    candidate of a kind the compiler refused waits behind those of kinds it has not, and one
    a refusal rules out (refused_alike) is passed over. Returns their outcomes and how many
    were passed over."""
    base = proxy_depths(cfg, args)
    plans: list[tuple[Screened, tuple | None, list]] = []

    def refusals(before: int) -> list[tuple[Screened, float | None]]:
        found = []
        for s, _, jobs in plans[:before]:
            for job in jobs:
                refused, peak = _refusal(job.result)
                if refused:
                    found.append((s, peak))
        return found

    def groups():
        rest = list(chosen)
        while rest:
            refused_kinds = {_kind(s) for s, _ in refusals(len(plans))}
            s = next((s for s in rest if _kind(s) not in refused_kinds), rest[0])
            rest.remove(s)
            layout = with_layout(cfg, s.candidate)
            unit = s.candidate.degree("stage")
            depths = tuple(d * unit for d in base) if base else None
            if depths and depths[1] * 2 > cfg.model.num_layers:
                depths = None
            mine = [_job(args, layout, s.candidate, topology, slices, d) for d in depths or (None,)]
            plans.append((s, depths, mine))
            yield mine

    def pass_over(group) -> str | None:
        screened = plans[-1][0]
        if screened.candidate == baseline:
            return None
        return refused_alike(screened, refusals(len(plans) - 1), chip.hbm_gib)

    limit = args.compiles + (baseline is not None)
    compiling.run_jobs(groups(), args.processes, args.budget, say, limit, pass_over)
    return _outcomes(cfg, plans, chip, chips * slices, baseline)


def _outcomes(cfg, plans, chip, total_chips: int, baseline) -> tuple[list, int]:
    """The compiled candidates' outcomes, and how many candidates were passed over."""
    tokens, flops = cfg.tokens_per_step, metrics.train_flops_per_token(cfg.model, cfg.train.seq_len)

    def mfu_of(step_s: float) -> float:
        return tokens * flops / step_s / total_chips / chip.peak_flops["bf16"]

    outcomes, passed_over = [], 0
    for s, depths, mine in plans:
        results = [j.result for j in mine]
        if any(r is None for r in results):  # beyond the limit: never taken
            continue
        if any(r.get("skipped", "").startswith(PASSED_OVER) for r in results):
            passed_over += 1
            continue
        verdict = report.at_depth(results, depths or (0,), cfg.model.num_layers, chip.hbm_gib)
        source = "cache" if all(j.cached for j in mine) else "compiled"
        if depths:
            source = f"proxy {depths[0]},{depths[1]} layers ({source})"
        out = report.outcome(s, s.candidate == baseline, verdict, source, mfu_of)
        out.cached = all(j.cached for j in mine)
        outcomes.append(out)
    return outcomes, passed_over


def _refusal(result: dict | None) -> tuple[bool, float | None]:
    """(the layout did not fit: refused by the compiler, or compiled over the chip's memory;
    the compiled peak where there is one)."""
    if result is None or "skipped" in result or "failed" in result:
        return False, None
    if "refused" in result:
        return True, None
    return not result["fits"], result.get("peak_gib")


def _kind(screened: Screened) -> tuple[str, bool]:
    """What the memory estimate's error mostly depends on: the remat policy, pipelined or not."""
    return screened.candidate.remat, screened.candidate.degree("stage") > 1


def refused_alike(
    screened: Screened, refusals: list[tuple[Screened, float | None]], hbm_gib: float
) -> str | None:
    """Why to pass over a candidate without compiling it: a layout of the same kind (remat
    policy, pipelined or not) did not fit, and this one's estimate is at least the bar that
    refusal sets: the refused layout's estimate, scaled down by how far over the chip its
    compile was where it was compiled (the estimate's error for that kind is at least that).
    The estimate errs mostly by kind (the activations remat keeps, a pipeline's in-flight
    buffers), so the compile goes to the next candidate instead. A heuristic: it may pass over
    a layout that would just fit."""
    for r, peak in refusals:
        same_kind = _kind(r) == _kind(screened)
        bar = r.estimate_gib * hbm_gib / peak if peak else r.estimate_gib
        if same_kind and screened.estimate_gib >= bar:
            compiled = f", compiled at {peak:.2f} GiB" if peak else ""
            return (
                f"{PASSED_OVER}: {r.candidate.label()} did not fit (estimate "
                f"{r.estimate_gib:.2f} GiB{compiled}): its kind from {bar:.2f} GiB does not"
            )
    return None


def _job(args, layout: Config, c, topology: str, slices: int, depth: int | None):
    overrides = [*args.overrides, *c.overrides(), f"mesh.num_slices={slices}"]
    if depth:
        overrides.append(f"model.num_layers={depth}")
        layout = layout.model_copy(
            update={"model": layout.model.model_copy(update={"num_layers": depth})}
        )
    return compiling.Job(
        str(Path(args.config).resolve()), overrides, topology, slices, layout.model_dump_json()
    )


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="plan", description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--topology", help="a TPU slice as libtpu names it: v5e:4x4, v6e:16x16")
    parser.add_argument("--slices", type=positive_int, help="slices joined by DCN")
    parser.add_argument("--device", help="NVIDIA GPUs instead: h100, h200, b200")
    parser.add_argument("--devices", type=positive_int, default=8, help="--device: GPUs")
    parser.add_argument(
        "--compiles",
        type=non_negative_int,
        default=6,
        help="candidates to compile besides the config's, first-order fastest first",
    )
    parser.add_argument("--processes", type=positive_int, default=2, help="compiles at a time")
    parser.add_argument("--budget", type=float, default=900.0, help="seconds for compiling")
    parser.add_argument(
        "--proxy",
        action="store_true",
        help="compile two reduced depths of a model of one layer kind and scale to its depth",
    )
    parser.add_argument("--out", default="plan.yml", help="the winner's overlay (YAML)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
