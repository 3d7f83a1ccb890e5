"""Schedules and the weight-decay mask."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from maxtrain import optim
from maxtrain.config import OptimConfig


def lrs(cfg: OptimConfig, steps: int) -> np.ndarray:
    schedule = optim.schedule(cfg, steps)
    return np.array([float(schedule(s)) for s in range(steps + 1)])


def test_warmup_then_cosine_to_the_floor():
    lr = lrs(OptimConfig(lr=1.0, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1), 110)
    np.testing.assert_allclose(lr[:11], np.linspace(0, 1, 11), atol=1e-6)  # linear warmup
    assert np.all(np.diff(lr[10:]) <= 1e-7)  # then never rises
    np.testing.assert_allclose(lr[60], 0.1 + 0.9 * 0.5, atol=1e-6)  # cosine midpoint
    np.testing.assert_allclose(lr[110], 0.1, atol=1e-6)


def test_wsd_is_flat_then_decays_linearly_over_its_fraction():
    cfg = OptimConfig(
        lr=2.0, warmup_steps=10, schedule="wsd", wsd_decay_fraction=0.2, min_lr_ratio=0.0
    )
    lr = lrs(cfg, 110)  # 100 post-warmup steps: 80 stable, 20 decaying
    np.testing.assert_allclose(lr[10:90], 2.0)
    np.testing.assert_allclose(lr[100], 1.0, atol=1e-6)
    np.testing.assert_allclose(lr[110], 0.0, atol=1e-6)


def test_constant_after_warmup():
    lr = lrs(OptimConfig(lr=0.5, warmup_steps=4, schedule="constant"), 20)
    np.testing.assert_allclose(lr[4:], 0.5)


def test_weight_decay_skips_norm_scales():
    params = {
        "embedding": jnp.ones((4, 2)),
        "layers": {
            "attn_norm": {"scale": jnp.ones((3, 2))},
            "mlp": {"up": {"kernel": jnp.ones((3, 2, 2))}},
        },
    }
    # zero gradients: the whole update is the decoupled decay, lr * wd * param
    tx, _ = optim.build(
        OptimConfig(lr=1.0, warmup_steps=0, schedule="constant", weight_decay=0.5, clip_norm=0.0),
        10,
    )
    state = tx.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, state, params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_allclose(new["layers"]["attn_norm"]["scale"], 1.0)  # not decayed
    np.testing.assert_allclose(new["embedding"], 0.5)  # decayed by lr * wd
    np.testing.assert_allclose(new["layers"]["mlp"]["up"]["kernel"], 0.5)


def test_gradients_are_clipped_to_the_global_norm_before_adam():
    """Two steps whose gradient norms differ 100x: Adam's moments see the clipped ones."""
    kw = dict(lr=1.0, warmup_steps=0, schedule="constant", weight_decay=0.0)
    tx, _ = optim.build(OptimConfig(**kw, clip_norm=1.0), 5)
    unclipped_tx, _ = optim.build(OptimConfig(**kw, clip_norm=0.0), 5)
    params = {"kernel": jnp.zeros(2)}
    raw = [jnp.array([30.0, 40.0]), jnp.array([0.3, 0.4])]  # norms 50 and 0.5
    clipped = [jnp.array([0.6, 0.8]), jnp.array([0.3, 0.4])]

    def second_update(transform, grads, norm_given=False):
        state = transform.init(params)
        for g in grads:
            extra = {"grad_norm": jnp.linalg.norm(g)} if norm_given else {}
            update, state = transform.update({"kernel": g}, state, params, **extra)
        return update["kernel"]

    np.testing.assert_allclose(
        second_update(tx, raw), second_update(unclipped_tx, clipped), rtol=1e-5
    )
    # train_step hands the norm in (computed once per step): the same clip.
    np.testing.assert_allclose(second_update(tx, raw, norm_given=True), second_update(tx, raw))
    assert not np.allclose(second_update(unclipped_tx, raw), second_update(tx, raw), rtol=1e-3)
