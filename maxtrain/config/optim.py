"""The `optim:` section: the optimizer, its schedule and clipping (maxtrain/optim.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from maxtrain.config.domains import Fraction, NonNegativeFloat, PositiveFloat, Section


class OptimConfig(Section):
    lr: NonNegativeFloat = 3e-4
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = Field(default=100, ge=0)
    # Steps the schedule spans (warmup included); None: train.steps. Its own key so that a run
    # extended by raising train.steps keeps its schedule (Config.schedule_steps resolves it).
    schedule_steps: int | None = Field(default=None, ge=1)
    min_lr_ratio: Fraction = 0.1
    wsd_decay_fraction: float = Field(default=0.2, gt=0, le=1, allow_inf_nan=False)
    b1: float = Field(default=0.9, ge=0, lt=1, allow_inf_nan=False)  # Adam's decay rates
    b2: float = Field(default=0.95, ge=0, lt=1, allow_inf_nan=False)
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.1
    clip_norm: NonNegativeFloat = 1.0  # 0 disables clipping
