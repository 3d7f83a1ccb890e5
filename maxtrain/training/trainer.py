"""The run's compiled machinery: its mesh, sharded state and jitted step and eval functions
(`build_trainer`), after the checks that need the mesh (the batch and the experts divide over
it). maxtrain/training/loop.py's loop drives it; tools (benchmark, quantize) build one the same way.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from maxtrain import optim, posttrain
from maxtrain.config import Config, ConfigError
from maxtrain.data import BATCH_KEYS, batch_sharding, to_global
from maxtrain.models import ModelDef
from maxtrain.parallel.context import check_context
from maxtrain.parallel.expert_exchanges import exchange_implementation, ragged_supported
from maxtrain.parallel.mesh import batch_degree, build_mesh, mesh_platform, sharding_rules
from maxtrain.training import metrics as metrics_lib
from maxtrain.training import run_model
from maxtrain.training.split import ParameterSplit
from maxtrain.training.state import (
    SavedLayout,
    TrainState,
    init_state,
    saved_layout,
    trained_shardings,
)
from maxtrain.training.step import eval_step, train_step


@dataclass
class Trainer:
    """The compiled pieces of a run, shared by the train loop and tools/benchmark.py."""

    cfg: Config
    mesh: Mesh
    mdef: ModelDef
    state: TrainState
    batch_sharding: NamedSharding
    step_fn: Any  # (state, batch) -> (state, metrics), donates state
    eval_fn: Any  # (params, frozen, batch) -> {nll_sum, tokens}
    flops_per_token: float
    shardings: TrainState  # of the state
    saved: SavedLayout  # the state as checkpoints hold it (parallel/pipeline.py)
    split: ParameterSplit  # what trains and what is frozen (training/split.py)

    def model_params(self) -> Any:
        """The parameters the model runs on: the trained part with the frozen one."""
        return self.split.combine(self.state.params, self.state.frozen)

    def saved_state(self) -> TrainState:
        """The state to hand a checkpointer: in model order, whatever the pipeline."""
        return self.saved.saved(self.state)

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The global batch the step takes, as shapes and shardings: what compiling the step
        needs, without reading data (for devices this host may not have:
        maxtrain/parallel/topology.py)."""
        shape = (self.cfg.train.global_batch_size, self.cfg.train.seq_len)
        spec = lambda dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding)  # noqa: E731
        return {key: spec(jnp.int32) for key in BATCH_KEYS}

    def global_batch(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This host's rows as the global batch the step takes."""
        return to_global(local, self.batch_sharding)


# How the train step keeps a non-finite step from touching the state (train_step.train_step),
# per platform: the form that costs no state copy and no extra pass over memory there, read
# from the compiled programs (tests/training/test_step_program.py,
# tests/parallel/test_tpu_compile.py). XLA:CPU copies every optimizer moment for a select
# (the state is donated, and the select needs the old moments after the new ones are
# written); the TPU compiler fuses the select into the update, while a conditional around the
# update cost 0.9 GB more bytes accessed per chip for a 1.5B model on v5e (5.5% of its step).
NONFINITE_GUARD = {"cpu": "cond", "gpu": "cond", "tpu": "select"}


def check_batch(cfg: Config, mesh: Mesh) -> None:
    degree = batch_degree(cfg.mesh.rules, mesh)
    if cfg.micro_batch_size % degree:
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size} over "
            f"train.grad_accum_steps={cfg.train.grad_accum_steps} gives micro-batches of "
            f"{cfg.micro_batch_size} sequences, not divisible by the data-parallel degree "
            f"{degree} (mesh axes {', '.join(cfg.mesh.rules.get('batch', []))})"
        )
    pipeline_microbatches = cfg.pipeline.microbatches or cfg.mesh.stage * cfg.mesh.dcn.stage
    if cfg.mesh.stage * cfg.mesh.dcn.stage > 1 and (
        cfg.micro_batch_size % pipeline_microbatches
        or (cfg.micro_batch_size // pipeline_microbatches) % degree
    ):
        raise ConfigError(
            f"micro-batches of {cfg.micro_batch_size} sequences do not split into "
            f"pipeline.microbatches={pipeline_microbatches} parts divisible by the "
            f"data-parallel degree {degree}"
        )
    if cfg.train.global_batch_size % jax.process_count():
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size} is not divisible by the "
            f"{jax.process_count()} processes"
        )


def check_experts(cfg: Config, mesh: Mesh) -> None:
    """Expert parallelism needs whole experts per device and tokens split the same way."""
    moe = cfg.model.moe
    if moe is None:
        return
    axes = [a for a in cfg.mesh.rules.get("exp", []) if mesh.shape[a] > 1]
    degree = math.prod(mesh.shape[a] for a in axes)
    if moe.num_experts % degree:
        raise ConfigError(
            f"model.moe.num_experts ({moe.num_experts}) is not divisible by the expert-parallel "
            f"degree {degree} (mesh axes {', '.join(axes)}); change mesh.expert or num_experts"
        )
    missing = [a for a in axes if a not in cfg.mesh.rules.get("batch", [])]
    if missing:
        raise ConfigError(
            f"mesh.rules.exp splits experts over {', '.join(missing)}, which mesh.rules.batch "
            f"does not split tokens over; add it to mesh.rules.batch"
        )
    exchange = exchange_implementation(cfg.compute.expert_exchange, mesh_platform(mesh))
    if degree > 1 and exchange == "ragged" and mesh_platform(mesh) == "cpu":
        raise ConfigError(
            "compute.expert_exchange=ragged needs a GPU or TPU (XLA:CPU has no ragged "
            "all-to-all); use all_to_all or all_gather, or auto"
        )
    chips = mesh.size // cfg.mesh.num_slices
    if (
        degree > 1
        and exchange == "ragged"
        and not ragged_supported(mesh.devices.flat[0].device_kind, chips)
    ):
        raise ConfigError(
            f"compute.expert_exchange=ragged does not compile on a {chips}-chip v5e slice (the TPU "
            "compiler has no ragged all-to-all under its limited ICI routing beyond 16 chips); "
            "use all_to_all or all_gather, or auto"
        )


def checked_for_devices(
    cfg: Config, devices: list[jax.Device] | None = None
) -> tuple[Config, Mesh]:
    """The config with its choices for the devices' platform (training/run_model.py
    for_platform), and their mesh, once the config is checked against them: the batch, the
    experts, the sequence and the pipeline stages split over the mesh (ConfigError if not).
    Cheap: a run calls it before it prepares data or state, so that these mistakes are
    refused before anything else is said."""
    mesh = build_mesh(cfg.mesh, devices)
    device = mesh.devices.flat[0]
    cfg = run_model.for_platform(
        cfg, device.platform, device.device_kind, mesh.size // cfg.mesh.num_slices
    )
    check_batch(cfg, mesh)
    check_experts(cfg, mesh)
    check_context(
        cfg.model,
        cfg.compute.context_layout,
        cfg.train.seq_len,
        cfg.mesh.rules.get("length", []),
        mesh.shape["context"],
    )
    run_model.stage_layout(cfg)
    return cfg, mesh


def build_trainer(
    cfg: Config, devices: list[jax.Device] | None = None, abstract: bool = False
) -> Trainer:
    """The run's mesh, state and compiled functions. abstract=True: the state as shapes and
    shardings only (state.init_state), for compiling the step without memory for it.
    devices: those of jax.devices() by default, or compile-only ones
    (maxtrain/parallel/topology.py); kernels, exchange and compute dtype are chosen for their
    platform (training/run_model.py for_platform), and the returned trainer's cfg holds those
    choices."""
    cfg, mesh = checked_for_devices(cfg, devices)
    with sharding_rules(mesh, cfg.mesh.rules):
        mdef = run_model.model_def(cfg)
        trained = trained_shardings(mdef, cfg, mesh)
    tx, lr_schedule = optim.build(cfg.optim, cfg.schedule_steps, trained)
    with sharding_rules(mesh, cfg.mesh.rules):
        state, shardings = init_state(cfg, mesh, mdef, tx, abstract)
        saved = saved_layout(cfg, mesh, tx, mdef)
    data_sharding = batch_sharding(mesh, cfg.mesh.rules)
    objective = posttrain.objective(cfg.train)
    split = posttrain.parameter_split(cfg)
    step = functools.partial(
        train_step,
        mdef=mdef,
        tx=tx,
        lr_schedule=lr_schedule,
        grad_accum_steps=cfg.train.grad_accum_steps,
        z_loss=cfg.train.z_loss,
        objective=objective,
        split=split,
        guard_nonfinite=NONFINITE_GUARD[mesh_platform(mesh)],
    )
    step_fn = jax.jit(
        _with_rules(step, mesh, cfg),
        in_shardings=(shardings, data_sharding),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )

    def evaluate(params, frozen, batch):
        reference = split.start(params, frozen) if objective.uses_reference else None
        model_params = split.combine(params, frozen)
        return eval_step(model_params, batch, mdef=mdef, objective=objective, reference=reference)

    eval_fn = jax.jit(
        _with_rules(evaluate, mesh, cfg),
        in_shardings=(shardings.params, shardings.frozen, data_sharding),
    )
    flops = metrics_lib.train_flops_per_token(cfg.model, cfg.train.seq_len)
    return Trainer(
        cfg,
        mesh,
        mdef,
        state,
        data_sharding,
        step_fn,
        eval_fn,
        flops,
        shardings,
        saved,
        split,
    )


def _with_rules(fn, mesh: Mesh, cfg: Config):
    """Traces `fn` with the config's logical-axis rules active (for activation constraints)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with sharding_rules(mesh, cfg.mesh.rules):
            return fn(*args, **kwargs)

    return wrapped


def compile_step(trainer: Trainer) -> tuple[Any, float, float]:
    """The train step compiled for the trainer's mesh from shapes alone (build it with
    abstract=True: nothing is allocated), with the seconds lowering and compiling took.

    The devices may be of another platform than this process's (compile-only TPU devices:
    maxtrain/parallel/topology.py). tokamax refuses to trace a kernel for a device the process
    cannot
    run on unless its cross-compile switch is on, and reads the hardware generation a kernel
    is built for from the default device: for exactly that case, the switch is on and the
    default device is one of the mesh's.
    """
    batch = trainer.abstract_batch()
    cross = mesh_platform(trainer.mesh) != jax.default_backend()
    with contextlib.ExitStack() as stack:
        if cross:
            stack.enter_context(_tokamax_cross_compile())
            stack.enter_context(jax.default_device(trainer.mesh.devices.flat[0]))
        t0 = time.perf_counter()
        lowered = trainer.step_fn.lower(trainer.state, batch)
        t1 = time.perf_counter()
        compiled = lowered.compile()
    return compiled, t1 - t0, time.perf_counter() - t1


def _tokamax_cross_compile():
    import tokamax  # seconds to import: only when compiling for other devices

    return tokamax.config.cross_compile(True)
