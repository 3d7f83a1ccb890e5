"""Trains one config with AdamW and with Muon, each at the best of a learning-rate sweep, and
prints one JSON line per run and one with the two winners.

    python tools/compare_optimizers.py [CONFIG.yml] [key=value ...]
        [--lrs 3e-3,6e-3,1.5e-3] [--optimizers adamw,muon] [--output-dir DIR]

Every run is the config as given (default configs/base.yml: the default model on the embedded
corpus) with only optim.name and optim.lr changed: the same seed, batches and token count, and
the same held-out eval at the last step, whose weighted loss picks each optimizer's best rate
(a run stopped by SIGTERM or Ctrl-C ends the sweep and takes no part).
Both sweep the same rates (Muon's update is scaled to AdamW's RMS, so its rate is on the same
scale), taking turns rate by rate, so a sweep cut short still compares like with like.
It also prints each optimizer's state bytes (its moments and counters, all devices together):
AdamW keeps two moments per parameter, Muon one per matrix and AdamW's two for the rest.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import jax
from flax import nnx

from maxtrain import config as config_lib
from maxtrain import optim
from maxtrain.common.errors import ArgumentParser, UserError, positive_float, refuse
from maxtrain.training.loop import run
from maxtrain.training.run_model import model_def

OPTIMIZERS = ("adamw", "muon")


def optimizer_state_bytes(cfg: config_lib.Config) -> int:
    """Bytes of the optimizer state for this config's parameters (shapes only, nothing run)."""
    tx, _ = optim.build(cfg.optim, cfg.train.steps)
    params = nnx.to_pure_dict(model_def(cfg).abstract_state)
    state = jax.eval_shape(tx.init, params)
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))


def learning_rates(text: str) -> list[float]:
    """An argparse type: comma-separated learning rates, each a finite number above 0."""
    return [positive_float(v) for v in text.split(",")]


def optimizers(text: str) -> list[str]:
    """An argparse type: comma-separated optimizer names."""
    names = text.split(",")
    if unknown := [n for n in names if n not in OPTIMIZERS]:
        raise argparse.ArgumentTypeError(f"{unknown[0]!r} is not one of {', '.join(OPTIMIZERS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", default=str(config_lib.CONFIGS_DIR / "base.yml"))
    parser.add_argument("overrides", nargs="*", help="dotted.key=value")
    parser.add_argument(
        "--lrs", type=learning_rates, default="3e-3,6e-3,1.5e-3", help="peak rates to sweep"
    )
    parser.add_argument(
        "--optimizers", type=optimizers, default=",".join(OPTIMIZERS), help="a subset to run"
    )
    parser.add_argument("--output-dir", default="runs/compare_optimizers")
    args = parser.parse_args(argv)
    try:
        steps = config_lib.load(args.config, args.overrides).train.steps
        best = {}
        for lr, name in itertools.product(args.lrs, args.optimizers):
            result = train_one(args, name, lr, steps)
            print(json.dumps(result), flush=True)
            if result["steps"] < steps:  # stopped by a signal: the sweep stops with it
                break
            if name not in best or result["eval_loss"] < best[name]["eval_loss"]:
                best[name] = result
    except UserError as e:
        return refuse("compare_optimizers", e)
    print(json.dumps({"best": best}), flush=True)
    return 0


def train_one(args, name: str, lr: float, steps: int) -> dict:
    """One run of the config with this optimizer and peak rate; evaluated once, at the end."""
    cfg = config_lib.load(
        args.config,
        [
            *args.overrides,
            f"optim.name={name}",
            f"optim.lr={lr}",
            f"run.output_dir={args.output_dir}",
            f"run.name={name}-lr{lr:g}",
            "checkpoint.enabled=false",
            f"train.eval_every={steps}",
        ],
    )
    summary = run(cfg)
    return {
        "optimizer": name,
        "lr": lr,
        "steps": summary["step"],
        "tokens": summary["step"] * cfg.tokens_per_step,
        "train_loss": summary.get("loss"),
        "eval_loss": summary.get("eval_loss"),
        "optimizer_state_bytes": optimizer_state_bytes(cfg),
    }
