"""The same function under different meshes and layouts: a synthetic batch, the mean loss and
its gradients on a trainer's mesh, and trees compared leaf by leaf."""

from __future__ import annotations

import jax
import numpy as np

from maxtrain.data import to_global
from maxtrain.data.synthetic import SyntheticText
from maxtrain.parallel.mesh import sharding_rules
from maxtrain.training.step import summed_grads


def synthetic_batch(cfg, step=0):
    """Step `step`'s global batch of the synthetic source, as host arrays."""
    source = SyntheticText(cfg.model.vocab_size, cfg.train.seq_len, 4, seed=0, stream=0)
    return source.batch(step, range(cfg.train.global_batch_size))


def loss_and_grads(trainer, local_batch):
    """Mean loss and its gradients, computed on the trainer's mesh, fetched to host."""
    cfg = trainer.cfg

    def fn(params, batch):
        with sharding_rules(trainer.mesh, cfg.mesh.rules):
            grads, sums = summed_grads(trainer.mdef, params, batch, 0.0)
        return sums.loss / sums.count, jax.tree.map(lambda g: g / sums.count, grads)

    batch = to_global(local_batch, trainer.batch_sharding)
    return jax.device_get(jax.jit(fn)(trainer.state.params, batch))


def assert_trees_close(a, b, rtol=2e-5, atol=2e-6):
    flat_a, flat_b = jax.tree.leaves_with_path(a), jax.tree.leaves(b)
    assert len(flat_a) == len(flat_b)
    for (path, x), y in zip(flat_a, flat_b, strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))
