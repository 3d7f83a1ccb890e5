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

from maxtrain.config import Config
from maxtrain.models import ModelDef
from maxtrain.parallel import pipeline
from maxtrain.parallel.mesh import logical_to_spec
from maxtrain.parallel.pipeline import StageLayout
from maxtrain.posttrain import parameter_split
from maxtrain.training import run_model
from maxtrain.training.run_model import model_def


@struct.dataclass
class TrainState:
    step: jax.Array
    # what the optimizer trains: the whole model, or a split's trained part (training/split.py)
    params: Any
    opt_state: Any
    # The split's frozen part (a LoRA run's base, DPO's reference copy), read from
    # checkpoint.load_parameters_path at every start and resume, never saved (SavedLayout drops
    # it). None when the whole model trains.
    frozen: Any = None


@struct.dataclass
class SavedState:
    """The train state as checkpoints hold it: step, params, optimizer state; never the frozen
    part (it is the checkpoint the run started from), so that every checkpoint, of any split,
    has this one structure."""

    step: jax.Array
    params: Any
    opt_state: Any

    def train_state(self, frozen: Any = None) -> TrainState:
        return TrainState(self.step, self.params, self.opt_state, frozen)


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


def trained_shardings(mdef: ModelDef, cfg: Config, mesh: Mesh) -> Any:
    """NamedSharding per trained parameter (the split's trained part): what Muon deals its
    matrices by (optim/muon_deal.py)."""
    return parameter_split(cfg).split(param_shardings(mdef, cfg, mesh))[0]


def state_shardings(
    mdef: ModelDef, cfg: Config, mesh: Mesh, tx: optax.GradientTransformation
) -> TrainState:
    split = parameter_split(cfg)
    params = trained_shardings(mdef, cfg, mesh)
    abstract_params, abstract_frozen = split.split(nnx.to_pure_dict(mdef.abstract_state))
    frozen = None
    if split.has_frozen:
        stored = functools.partial(split.stored, abstract_state=mdef.abstract_state)
        frozen = _leaf_shardings(jax.eval_shape(stored, abstract_frozen), mdef, cfg, mesh)
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
    return TrainState(step=replicated, params=params, opt_state=opt, frozen=frozen)


def abstract_frozen(mdef: ModelDef, cfg: Config, mesh: Mesh) -> dict:
    """The split's frozen part as checkpoint.load_parameters_path holds it (unquantized, its
    layers in model order whatever the pipeline), as shapes and shardings: what it is read
    into."""
    if mdef.layout is not None:
        mdef = model_def(cfg, pipelined=False)
    split = parameter_split(cfg)
    shapes = split.split(nnx.to_pure_dict(mdef.abstract_state))[1]
    return _with_shardings(shapes, split.split(param_shardings(mdef, cfg, mesh))[1])


def frozen_state(cfg: Config, mdef: ModelDef, shardings: TrainState, loaded: dict) -> Any:
    """The loaded frozen part (in model order: abstract_frozen) as the state keeps it
    (state.frozen): moved into the run's pipeline stages, if any, stored as the split stores
    it (QLoRA: quantized), on the frozen part's shardings."""
    split = parameter_split(cfg)

    def kept(frozen: dict) -> dict:
        if mdef.layout is not None:
            frozen = pipeline.to_stages(frozen, mdef.layout)
        return split.stored(frozen, mdef.abstract_state)

    return jax.jit(kept, out_shardings=shardings.frozen)(loaded)


def _leaf_shardings(tree: Any, mdef: ModelDef, cfg: Config, mesh: Mesh) -> Any:
    """A NamedSharding for every leaf of a params-shaped tree (leaf_specs)."""
    specs = leaf_specs(tree, mdef.abstract_state, cfg.mesh.rules, mesh)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)


def leaf_specs(tree: Any, abstract_state: nnx.State, rules: dict, mesh: Any) -> Any:
    """A PartitionSpec for every leaf of a params-shaped tree, from the logical axes of the
    parameter it belongs to and its own shape: a quantized kernel's values and scales are split
    like it, wherever their shape allows. mesh: a Mesh or an AbstractMesh (the dry-run's)."""
    axes = {
        tuple(str(k) for k in path): var.get_metadata().get("out_sharding")
        for path, var in nnx.to_flat_state(abstract_state)
    }

    def spec(path, leaf) -> P:
        names = tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
        return logical_to_spec(axes[names] or (None,) * leaf.ndim, rules, mesh, leaf.shape)

    return jax.tree_util.tree_map_with_path(spec, tree)


def init_state(
    cfg: Config,
    mesh: Mesh,
    mdef: ModelDef,
    tx: optax.GradientTransformation,
    abstract: bool = False,
) -> tuple[TrainState, TrainState]:
    """Returns (state, shardings of the state) for the model `mdef` (model_def(cfg)),
    parameters born sharded.

    A pipelined model starts from the parameters the plain one is initialised with, moved into
    its stages: the same run with or without stages starts from the same model. abstract=True:
    the state's shapes and shardings only, nothing allocated (to compile a step for a model
    bigger than this host: tools/benchmark.py --dry-run --compile).
    """
    shardings = state_shardings(mdef, cfg, mesh, tx)
    split = parameter_split(cfg)

    def create() -> TrainState:
        model = run_model.build_model(cfg, seed=cfg.run.seed)
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        if mdef.layout is not None:
            params = pipeline.to_stages(params, mdef.layout)
        # A frozen part is replaced by the loaded one (training/loop.py).
        params, frozen = split.split(params)
        if frozen is not None:
            frozen = split.stored(frozen, mdef.abstract_state)
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), frozen=frozen
        )

    if abstract:
        state = _with_shardings(jax.eval_shape(create), shardings)
    else:
        state = jax.jit(create, out_shardings=shardings)()
    return state, shardings


def _with_shardings(shapes: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


@dataclass(frozen=True)
class SavedLayout:
    """The train state as checkpoints hold it, and the conversions to and from the run's.

    Checkpoints keep the layers in model order whatever the pipeline (parallel/pipeline.py), so
    any run, pipelined or not, resumes from them and every tool reads them. Without a pipeline
    the two layouts are the same and nothing is converted; with one, a save first copies the
    state into model order on the devices (a transient second copy of the layer parameters and
    optimizer moments, and for repeats > 1 an exchange between stages), and a restore moves it
    back into the stages.
    """

    layout: StageLayout | None
    shardings: SavedState  # of the state in model order

    def saved(self, state: TrainState) -> SavedState:
        """The state to save: in model order, without the frozen part."""
        saved = SavedState(state.step, state.params, state.opt_state)
        return saved if self.layout is None else self._to_saved(saved)

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
    in_model_order = mdef if mdef.layout is None else model_def(cfg, pipelined=False)
    shardings = state_shardings(in_model_order, cfg, mesh, tx)
    return SavedLayout(
        mdef.layout, SavedState(shardings.step, shardings.params, shardings.opt_state)
    )
