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
    """Compiles the config's layout and `args.compiles` of the chosen candidates after it, in
    order (two proxy depths each where proxy_depths says so), passing over those a refusal
    rules out (refused_alike); returns their outcomes and how many were passed over."""
    base = proxy_depths(cfg, args)
    plans: list[tuple[Screened, tuple | None, list]] = []

    def groups():
        for s in chosen:
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
        refused = [s for s, _, jobs in plans[:-1] if any(_refused(j.result) for j in jobs)]
        return refused_alike(screened, refused)

    limit = args.compiles + (baseline is not None)
    compiling.run_jobs(groups(), args.processes, args.budget, say, limit, pass_over)
    tokens, flops = cfg.tokens_per_step, metrics.train_flops_per_token(cfg.model, cfg.train.seq_len)
    total = chips * slices

    def mfu_of(step_s: float) -> float:
        return tokens * flops / step_s / total / chip.peak_flops["bf16"]

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


def _refused(result: dict | None) -> bool:
    """The compiler refused the layout, or compiled it over the chip's memory."""
    return result is not None and ("refused" in result or ("fits" in result and not result["fits"]))


def refused_alike(screened: Screened, refused: list[Screened]) -> str | None:
    """Why to pass over a candidate without compiling it: a layout with the same remat policy
    and pipelining, whose memory estimate is no larger, did not fit. The estimate's error
    depends mostly on those two (remat's kept activations, a pipeline's in-flight buffers), so
    a larger estimate of the same kind would very likely not fit either; the compile goes to
    the next candidate instead. A heuristic: it may pass over a layout that would just fit."""
    c = screened.candidate
    for r in refused:
        same_kind = r.candidate.remat == c.remat and (r.candidate.degree("stage") > 1) == (
            c.degree("stage") > 1
        )
        if same_kind and screened.estimate_gib >= r.estimate_gib:
            label, gib = r.candidate.label(), r.estimate_gib
            return f"{PASSED_OVER}: {label} did not fit at an estimate of {gib:.2f} GiB"
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
