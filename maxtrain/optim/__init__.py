"""Optimizers: the factory picked by optim.name (AdamW, Muon), global-norm clipping, and the
learning-rate schedules. `optim.build(cfg.optim, steps)` -> (optax transform, schedule)."""

from maxtrain.optim.factory import build, decay_mask
from maxtrain.optim.schedules import schedule, warmup_warning

__all__ = ["build", "decay_mask", "schedule", "warmup_warning"]
