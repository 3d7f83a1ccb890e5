"""The train state (step, params, optimizer state), created directly in its sharded layout.

Parameters are a plain nested dict of arrays (see models/definition.py); their shardings come
from each parameter's logical axes and the config's mesh rules.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from maxtrain import models
from maxtrain.config import Config
from maxtrain.mesh import logical_to_spec
from maxtrain.models import ModelDef, model_def, pipeline
from maxtrain.models.pipeline import StageLayout


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any


def param_shardings(mdef: ModelDef, cfg: Config, mesh: Mesh) -> Any:
    """NamedSharding per parameter, from its logical axes and the config's rules."""

    def sharding(var: nnx.Variable) -> NamedSharding:
        axes = var.get_metadata().get("out_sharding") or (None,) * var.get_value().ndim
        return NamedSharding(
            mesh, logical_to_spec(axes, cfg.mesh.rules, mesh, var.get_value().shape)
        )

    shardings = jax.tree.map(
        sharding, mdef.abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return nnx.to_pure_dict(shardings)


def state_shardings(
    mdef: ModelDef, cfg: Config, mesh: Mesh, tx: optax.GradientTransformation
) -> TrainState:
    params = param_shardings(mdef, cfg, mesh)
    abstract_params = nnx.to_pure_dict(mdef.abstract_state)
    replicated = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    # Optimizer moments mirror the params they belong to; counters and the like replicate.
    # A partitioned optimizer (optim.name muon) holds MaskedNode where another part owns a leaf.
    opt = optax.tree_map_params(
        tx,
        lambda v, s: v if isinstance(v, optax.MaskedNode) else s,
        abstract_opt,
        params,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda v: isinstance(v, optax.MaskedNode),
    )
    return TrainState(step=replicated, params=params, opt_state=opt)


def init_state(
    cfg: Config, mesh: Mesh, tx: optax.GradientTransformation, abstract: bool = False
) -> tuple[TrainState, ModelDef, TrainState]:
    """Returns (state, model definition, shardings of the state), parameters born sharded.

    A pipelined model starts from the parameters the plain one is initialised with, moved into
    its stages: the same run with or without stages starts from the same model. abstract=True:
    the state's shapes and shardings only, nothing allocated (to compile a step for a model
    bigger than this host: tools/benchmark.py --dry-run --compile).
    """
    mdef = model_def(cfg)
    shardings = state_shardings(mdef, cfg, mesh, tx)

    def create() -> TrainState:
        model = models.build(cfg.model, seed=cfg.run.seed)
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        if mdef.layout is not None:
            params = pipeline.to_stages(params, mdef.layout)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    if abstract:
        state = _with_shardings(jax.eval_shape(create), shardings)
    else:
        state = jax.jit(create, out_shardings=shardings)()
    return state, mdef, shardings


def _with_shardings(shapes: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


@dataclass(frozen=True)
class SavedLayout:
    """The train state as checkpoints hold it, and the conversions to and from the run's.

    Checkpoints keep the layers in model order whatever the pipeline (models/pipeline.py), so
    any run, pipelined or not, resumes from them and every tool reads them. Without a pipeline
    the two layouts are the same and nothing is converted; with one, a save first copies the
    state into model order on the devices (a transient second copy of the layer parameters and
    optimizer moments, and for repeats > 1 an exchange between stages), and a restore moves it
    back into the stages.
    """

    layout: StageLayout | None
    shardings: TrainState  # of the state in model order

    def saved(self, state: TrainState) -> TrainState:
        """The state to save: in model order."""
        return state if self.layout is None else self._to_saved(state)

    def abstract(self, state: TrainState) -> Any:
        """The saved state's shapes and shardings: the target a restore reads into."""
        return _with_shardings(jax.eval_shape(self.saved, state), self.shardings)

    def restored(self, state: Any, run_shardings: Any) -> Any:
        """A state (or params) read from a checkpoint, laid out as the run's."""
        if self.layout is None:
            return state
        convert = functools.partial(pipeline.map_params, convert=self._to_stages)
        return jax.jit(convert, out_shardings=run_shardings)(state)

    @functools.cached_property
    def _to_saved(self):
        convert = functools.partial(pipeline.map_params, convert=self._to_model_order)
        return jax.jit(convert, out_shardings=self.shardings)

    def _to_model_order(self, params: dict) -> dict:
        return pipeline.to_model_order(params, self.layout)

    def _to_stages(self, params: dict) -> dict:
        return pipeline.to_stages(params, self.layout)


def saved_layout(
    cfg: Config, mesh: Mesh, tx: optax.GradientTransformation, mdef: ModelDef
) -> SavedLayout:
    if mdef.layout is None:
        return SavedLayout(None, state_shardings(mdef, cfg, mesh, tx))
    return SavedLayout(mdef.layout, state_shardings(model_def(cfg, pipelined=False), cfg, mesh, tx))
