"""The learning rate by step: linear warmup, then cosine, warmup-stable-decay or constant."""

from __future__ import annotations

import optax

from maxtrain.config import OptimConfig


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Learning rate by step: linear warmup, then the configured shape down to lr*min_lr_ratio."""
    warmup = min(cfg.warmup_steps, total_steps)
    rest = max(total_steps - warmup, 1)
    floor = cfg.lr * cfg.min_lr_ratio
    ramp = optax.linear_schedule(0.0, cfg.lr, max(warmup, 1))
    if cfg.schedule == "constant":
        after = optax.constant_schedule(cfg.lr)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, rest, alpha=cfg.min_lr_ratio)
    else:  # wsd: warmup, stable at peak, then linear decay over the last wsd_decay_fraction
        decay = max(int(rest * cfg.wsd_decay_fraction), 1)
        after = optax.join_schedules(
            [optax.constant_schedule(cfg.lr), optax.linear_schedule(cfg.lr, floor, decay)],
            [rest - decay],
        )
    if warmup == 0:
        return after
    return optax.join_schedules([ramp, after], [warmup])


def warmup_warning(cfg: OptimConfig, schedule_steps: int) -> str | None:
    """What is wrong with a warmup that does not end before the schedule does (the run would
    end mid-warmup, never decaying: train.steps=20 with optim.warmup_steps=30); None if nothing
    is. Only a warmup the config sets is warned about: the default's 30 steps in a shorter run
    are a smoke test's (every short documented command printed the warning), and at lr 0
    nothing trains."""
    set_here = "warmup_steps" in cfg.model_fields_set
    if not set_here or cfg.lr == 0 or cfg.schedule == "constant":
        return None
    if cfg.warmup_steps < schedule_steps:
        return None
    return (
        f"optim.warmup_steps={cfg.warmup_steps} is not shorter than the schedule "
        f"({schedule_steps} steps): the learning rate never decays; lower optim.warmup_steps"
    )
