"""The train state (step, params, optimizer state), created directly in its sharded layout.

Parameters are a plain nested dict of arrays (see models/definition.py); their shardings come
from each parameter's logical axes and the config's mesh rules.
"""

from __future__ import annotations

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
from maxtrain.models import ModelDef, model_def


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
    opt = optax.tree_map_params(
        tx,
        lambda _, s: s,
        abstract_opt,
        params,
        transform_non_params=lambda _: replicated,
    )
    return TrainState(step=replicated, params=params, opt_state=opt)


def init_state(
    cfg: Config, mesh: Mesh, tx: optax.GradientTransformation
) -> tuple[TrainState, ModelDef, TrainState]:
    """Returns (state, model definition, shardings of the state), parameters born sharded."""
    mdef = model_def(cfg)
    shardings = state_shardings(mdef, cfg, mesh, tx)

    def create() -> TrainState:
        params = nnx.to_pure_dict(nnx.state(models.build(cfg.model, seed=cfg.run.seed), nnx.Param))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    state = jax.jit(create, out_shardings=shardings)()
    return state, mdef, shardings
