"""The `optim:` section: the optimizer, its schedule and clipping (maxtrain/optim/factory.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from maxtrain.config.domains import Fraction, NonNegativeFloat, PositiveFloat, Section

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class MuonConfig(Section):
    """optim.name muon: the weight matrices' hyper-parameters (maxtrain/optim/muon.py); everything
    else (embeddings, output head, router, norms) takes the AdamW keys of optim."""

    momentum: float = Field(default=0.95, ge=0, lt=1, allow_inf_nan=False)
    nesterov: bool = True
    ns_steps: int = Field(default=5, ge=1, le=20)  # Newton-Schulz iterations
    # The quintic's coefficients (a, b, c): X <- a X + (b A + c A^2) X, A = X X^T.
    ns_coeffs: list[FiniteFloat] = Field(
        default=[3.4445, -4.7750, 2.0315], min_length=3, max_length=3
    )
    rms_scale: PositiveFloat = 0.2  # update scaled by rms_scale * sqrt(max(rows, cols))
    weight_decay: NonNegativeFloat = 0.1


class OptimConfig(Section):
    """The optimizer (AdamW or Muon) and its learning-rate schedule (maxtrain/optim/)."""

    name: Literal["adamw", "muon"] = "adamw"
    lr: NonNegativeFloat = 3e-3
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = Field(default=30, ge=0)
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
    # MuonClip's QK-clip (Kimi K2; models/qk_clip.py): after each update, the query and key
    # weights of every attention head whose largest logit over the step's batch exceeded this
    # are scaled down so that it would have been this. None: off.
    qk_clip_threshold: PositiveFloat | None = None
    muon: MuonConfig = MuonConfig()
