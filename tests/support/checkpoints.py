"""Train states with random values and a Checkpointer factory for checkpoint tests: real Orbax
writes without building (and compiling) a real train state."""

from __future__ import annotations

from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtrain import config as config_lib
from maxtrain import optim
from maxtrain.checkpointing import Checkpointer, integrity
from maxtrain.parallel.mesh import build_mesh, sharding_rules
from maxtrain.training.run_model import model_def
from maxtrain.training.state import TrainState, state_shardings


def random_state(cfg, devices=None, seed=0) -> TrainState:
    """A TrainState of the config's model, laid out as init_state lays it out, with random
    values in every leaf (nothing compiled: building the real one costs seconds per test)."""
    mesh = build_mesh(cfg.mesh, devices)
    tx, _ = optim.build(cfg.optim, cfg.train.steps)
    with sharding_rules(mesh, cfg.mesh.rules):
        mdef = model_def(cfg)
        shardings = state_shardings(mdef, cfg, mesh, tx)
    params = nnx.to_pure_dict(mdef.abstract_state)
    shapes = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=params,
        opt_state=jax.eval_shape(tx.init, params),
    )
    return randomize(shapes, shardings, seed)


def randomize(state, shardings=None, seed=0):
    """Distinct random values in every leaf (floats and ints), with the given shardings."""
    shardings = shardings if shardings is not None else jax.tree.map(lambda x: x.sharding, state)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    out = []
    for x, sharding in zip(leaves, jax.tree.leaves(shardings), strict=True):
        if jnp.issubdtype(x.dtype, jnp.floating):
            value = rng.standard_normal(x.shape).astype(x.dtype)
        else:
            value = rng.integers(0, 1000, x.shape).astype(x.dtype)
        out.append(jax.device_put(value, sharding))
    return jax.tree.unflatten(treedef, out)


def abstract(state, shardings=None):
    shardings = shardings if shardings is not None else jax.tree.map(lambda x: x.sharding, state)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )


def assert_bit_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def grain_iterator():
    return iter(grain.MapDataset.range(100).shuffle(seed=1).to_iter_dataset())


@pytest.fixture
def setup(make_cfg):
    """(cfg, trainer state with random values, log lines, Checkpointer factory)."""

    def make(*overrides: str, devices=None):
        cfg = make_cfg(
            "checkpoint.local.every_steps=10",
            "checkpoint.persistent.every_steps=20",
            *overrides,
        )
        state = random_state(cfg, devices)
        logs: list[str] = []

        def checkpointer(**kw):
            return Checkpointer(
                cfg.checkpoint, cfg.run_dir, config_lib.to_yaml(cfg), log=logs.append, **kw
            )

        return cfg, state, logs, checkpointer

    return make


def with_step(state, step):
    return state.replace(step=jax.device_put(np.int32(step), state.step.sharding))


def largest_data_file(step_dir: Path) -> Path:
    """The largest array-data file of a saved step: what a damaged disk truncates."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    return max(files, key=lambda p: p.stat().st_size)


CORRUPTIONS = {
    "truncated array data": lambda d: largest_data_file(d).write_bytes(b""),
    "deleted array data": lambda d: largest_data_file(d).unlink(),
    "deleted iterator state": lambda d: (d / "data" / "process_0-of-1.json").unlink(),
    "deleted manifest": lambda d: (d / integrity.MANIFEST).unlink(),
    "deleted commit file": lambda d: (d / integrity.COMMIT_FILE).unlink(),
}
