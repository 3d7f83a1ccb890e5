"""The optimizer: global-norm clipping then AdamW, or Muon on the weight matrices and AdamW on
the rest (optim.name, optim/muon.py), on the schedule of optim/schedules.py."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from maxtrain.config import OptimConfig
from maxtrain.optim import muon
from maxtrain.optim.schedules import schedule


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
    cfg: OptimConfig, total_steps: int, shardings: Any = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The transform and its schedule. shardings: the trained parameters' NamedShardings, for
    Muon to deal its matrices over the devices that share them (optim/muon_deal.py); None on
    one device."""
    lr = schedule(cfg, total_steps)
    parts = [clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
    adamw = optax.adamw(
        lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask
    )
    parts.append(muon.muon(cfg, lr, adamw, shardings) if cfg.name == "muon" else adamw)
    return optax.chain(*parts), lr
