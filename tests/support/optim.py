"""Optimizer helpers shared by the optimizer tests."""

import optax

from maxtrain.config import OptimConfig


def muon_cfg(**kw) -> OptimConfig:
    """Muon at a constant rate, unclipped: each step's update is Muon's alone."""
    return OptimConfig(
        name="muon", lr=0.02, warmup_steps=0, schedule="constant", clip_norm=0.0, **kw
    )


def apply(tx, params, grads_per_step):
    """params after one tx step per gradient tree, from tx's initial state."""
    state = tx.init(params)
    for grads in grads_per_step:
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params
