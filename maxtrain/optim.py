"""The optimizer: global-norm clipping then AdamW, or Muon on the weight matrices and AdamW on
the rest (optim.name, maxtrain/muon.py), on a warmup + cosine/WSD/constant schedule."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
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


def warmup_warning(cfg: OptimConfig, schedule_steps: int) -> str | None:
    """What is wrong with a warmup that does not end before the schedule does (the run would
    end mid-warmup, never decaying: train.steps=20 with the default 30 warmup steps); None if
    nothing is."""
    if cfg.schedule == "constant" or cfg.warmup_steps < schedule_steps:
        return None
    return (
        f"optim.warmup_steps={cfg.warmup_steps} is not shorter than the schedule "
        f"({schedule_steps} steps): the learning rate never decays; lower optim.warmup_steps"
    )


def decay_mask(params: Any) -> Any:
    """True for matmul kernels and embeddings; norm scales (and any bias) get no weight decay."""

    def decays(path: tuple, _leaf: Any) -> bool:
        name = str(getattr(path[-1], "key", path[-1]))
        return name in ("kernel", "embedding")

    return jax.tree_util.tree_map_with_path(decays, params)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm with the norm handed in by the caller (`tx.update(...,
    grad_norm=...)`) and the clip a multiply by one scalar. train_step computes the global norm
    once, for its metrics and the non-finite check, and runs the update under a conditional:
    a norm computed again inside it could not be shared (one more pass over every gradient),
    and optax's select-and-divide per element is not fused into the update there (one more
    pass again), where a scalar multiply is. Its state is optax's clip's (empty), so
    checkpoints are unchanged; the clipped values may differ from optax's in the last bit."""

    def update(updates: Any, state: Any, params: Any = None, *, grad_norm=None, **extra):
        del params, extra
        if grad_norm is None:  # a caller that has not computed it (tools, tests)
            grad_norm = optax.tree.norm(updates)
        scale = jnp.where(grad_norm < max_norm, 1.0, max_norm / grad_norm)
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def build(
    cfg: OptimConfig, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    lr = schedule(cfg, total_steps)
    parts = [clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
    adamw = optax.adamw(
        lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask
    )
    parts.append(muon.muon(cfg, lr, adamw) if cfg.name == "muon" else adamw)
    return optax.chain(*parts), lr
