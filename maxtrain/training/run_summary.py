"""`<run_dir>/summary.json`: what a run did, in one small file, for scripts that compare runs.

Its keys are metrics.jsonl's (`train/loss`, `eval/loss`, `eval/prose/loss`, ...: the newest
value of each), plus what only the whole run knows: `step`, `tokens_seen` (step x tokens per
step, across resumes), `params_total` and `params_active` (per token; they differ for MoE),
`wall_time_s` (of the invocation that wrote it) and `stopped_by` when a signal ended it.

A run killed after its final checkpoint but before this file is written is complete, and the
next start says so instead of training; it then writes the summary from metrics.jsonl
(`from_metrics`), without a wall time, which that start cannot know.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from maxtrain import models as model_lib
from maxtrain.common.files import write_atomic
from maxtrain.common.units import count
from maxtrain.config import Config
from maxtrain.posttrain import parameter_split

FILE = "summary.json"


def basics(cfg: Config, step: int) -> dict[str, Any]:
    """The keys every summary has, whatever wrote it."""
    return {
        "step": step,
        "tokens_seen": step * cfg.tokens_per_step,
        "params_total": model_lib.param_count(cfg.model),
        "params_active": model_lib.active_param_count(cfg.model),
    }


def from_metrics(cfg: Config, step: int) -> dict[str, Any]:
    """The summary of a run that ended at `step` without writing one: basics plus the newest
    value of each key metrics.jsonl logged up to that step (non-numbers, i.e. histograms, left
    out)."""
    newest: dict[str, Any] = {}
    path = cfg.run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    for record in map(json.loads, lines):
        if record.get("step", 0) <= step:
            newest.update({k: v for k, v in record.items() if isinstance(v, int | float)})
    newest.pop("step", None)
    return {**basics(cfg, step), **newest}


def write(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Writes it whole or not at all (a kill mid-write leaves none, and the next start
    writes it)."""
    path = Path(run_dir) / FILE
    write_atomic(path, json.dumps(summary, indent=2))
    return path


def describe_start(cfg: Config) -> str:
    """The start-up line saying what is trained: parameters (total, active per token; the
    checkpoint they start from; what trains of them where not all do: training/split.py), the
    matmuls' quantization, steps and the schedule's length."""
    split = parameter_split(cfg)
    start = cfg.checkpoint.load_parameters_path
    started = f"from {start}, " if start and split.loads_trained else ""
    preset, rules = cfg.quantization.preset, cfg.quantization.rules
    matmuls = f"{preset} matmuls, " if preset != "none" else "quantized matmuls, " if rules else ""
    return (
        f"maxtrain: {count(model_lib.param_count(cfg.model))} parameters "
        f"({count(model_lib.active_param_count(cfg.model))} active per token), {started}"
        f"{split.describe(cfg)}{matmuls}"
        f"{cfg.train.steps} steps of {count(cfg.tokens_per_step)} tokens, "
        f"lr schedule {cfg.optim.schedule} over {cfg.schedule_steps} steps"
    )


def describe_end(summary: dict[str, Any], path: Path) -> str:
    """The last line of a run: its step, wall time, tokens and final loss, and where the
    summary is."""
    which = "eval/loss" if "eval/loss" in summary else "train/loss"
    loss = f", {which} {summary[which]:.4f}" if which in summary else ""
    return (
        f"maxtrain: done at step {summary['step']} in {summary['wall_time_s']:.0f} s, "
        f"{count(summary['tokens_seen'])} tokens seen{loss}; summary in {path}"
    )
