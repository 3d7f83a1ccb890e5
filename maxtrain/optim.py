"""The optimizer: global-norm clipping then AdamW, or Muon on the weight matrices and AdamW on
the rest (optim.name, maxtrain/muon.py), on a warmup + cosine/WSD/constant schedule."""

from __future__ import annotations

from typing import Any

import jax
import optax

from maxtrain import muon
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


def decay_mask(params: Any) -> Any:
    """True for matmul kernels and embeddings; norm scales (and any bias) get no weight decay."""

    def decays(path: tuple, _leaf: Any) -> bool:
        name = str(getattr(path[-1], "key", path[-1]))
        return name in ("kernel", "embedding")

    return jax.tree_util.tree_map_with_path(decays, params)


def build(
    cfg: OptimConfig, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    lr = schedule(cfg, total_steps)
    parts = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
    adamw = optax.adamw(
        lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask
    )
    parts.append(muon.muon(cfg, lr, adamw) if cfg.name == "muon" else adamw)
    return optax.chain(*parts), lr
