"""The compiled train step pays only for its math: the non-finite guard (a step whose loss or
gradient is NaN/inf leaves the state as it was) costs no copy of any state buffer and no extra
pass over memory, read from the compiled program of each kind of step. A guard written as a
select after the update made XLA copy every optimizer moment at the start of each step (the
state is donated, and the select needs the old moments after the new ones are written).

Each program also holds no more copy instructions than it does today (analysis/program.py
copy_count): on CPU they are mostly transposes into a dot's operand layout, which the bytes
hardly show. Attention's custom VJP written with token-major einsums took the dense step from
73 to 81 (docs/benchmarks.md's 2-layer step: 64 to 71) until its kernel went heads-major."""

import functools

import jax
import pytest

from maxtrain import optim
from maxtrain.analysis.program import copy_count, entry_parameter_copies
from maxtrain.parallel.topology import topology_devices
from maxtrain.training.step import train_step
from maxtrain.training.trainer import NONFINITE_GUARD, _with_rules, build_trainer, compile_step


def compiled_steps(cfg, devices=None):
    """The trainer's compiled step (guarded) and the same step without the guard, for this
    host's devices or compile-only ones (maxtrain/parallel/topology.py)."""
    trainer = build_trainer(cfg, devices=devices, abstract=True)
    batch = trainer.abstract_batch()
    tx, lr_schedule = optim.build(cfg.optim, cfg.train.steps)
    unguarded = functools.partial(
        train_step,
        mdef=trainer.mdef,
        tx=tx,
        lr_schedule=lr_schedule,
        grad_accum_steps=cfg.train.grad_accum_steps,
        z_loss=cfg.train.z_loss,
        split=trainer.split,
        guard_nonfinite="off",
    )
    unguarded_fn = jax.jit(
        _with_rules(unguarded, trainer.mesh, cfg),
        in_shardings=(trainer.shardings, trainer.batch_sharding),
        out_shardings=(trainer.shardings, None),
        donate_argnums=0,
    )
    guarded, _, _ = compile_step(trainer)
    return guarded, unguarded_fn.lower(trainer.state, batch).compile()


@pytest.mark.parametrize(
    "overrides, most_copies",
    [
        (("mesh.fsdp=8",), 73),
        # Tied: XLA:CPU gives an untied head's gradient (a dot's output) a transposed layout, and
        # an operand of the update's conditional must be in the default one: one transpose of
        # that one gradient leaf (here +1.5% of bytes with mesh.expert=4, +3.2% with expert=8,
        # 0.5% for the dense model). It is a layout choice of the CPU backend, not a state copy.
        # 131 since the experts' FSDP shards are gathered inside their shard_map (122 before;
        # parallel/experts.py): the TPU program's step got faster, XLA:CPU's holds 9 more.
        (("model_name=tiny-moe", "mesh.expert=4", "mesh.fsdp=2", "model.tie_embeddings=true"), 131),
        (("mesh.fsdp=8", "train.grad_accum_steps=2", "train.global_batch_size=16"), 86),
        (("mesh.stage=2", "mesh.fsdp=4", "pipeline.microbatches=2", "model.num_layers=4"), 132),
        # LoRA: the frozen (nf4) base goes through the donated step unchanged, never copied.
        (
            (
                "mesh.fsdp=8",
                "lora.rank=4",
                "lora.base_quantization=nf4",
                "lora.block_size=16",
                "checkpoint.load_parameters_path=unused",
            ),
            140,
        ),
    ],
    ids=["dense", "moe", "grad_accum", "stages", "lora"],
)
def test_the_nonfinite_guard_copies_no_state_and_adds_no_bytes(make_cfg, overrides, most_copies):
    guarded, unguarded = compiled_steps(make_cfg(*overrides))
    # Scalars (the step count, the optimizer's counter) may be copied; no array of the state is.
    copied = [(name, size) for name, size in entry_parameter_copies(guarded.as_text()) if size > 8]
    assert not copied, copied
    with_guard = guarded.cost_analysis()["bytes accessed"]
    without = unguarded.cost_analysis()["bytes accessed"]
    assert with_guard <= 1.01 * without, (with_guard, without)
    copies = copy_count(guarded.as_text())
    assert copies <= most_copies, f"{copies} copy instructions, at most {most_copies} expected"


def test_the_guard_on_tpu_costs_no_copy_and_no_bytes(make_cfg):
    """The TPU compiler fuses a select into the update (trainer.NONFINITE_GUARD): no state
    copy, and no more bytes than the unguarded step, in the program a v5e slice would run."""
    assert NONFINITE_GUARD["tpu"] == "select"
    cfg = make_cfg("mesh.fsdp=4", "train.seq_len=128")
    guarded, unguarded = compiled_steps(cfg, list(topology_devices("v5e:2x2")))
    copied = [(name, size) for name, size in entry_parameter_copies(guarded.as_text()) if size > 8]
    assert not copied, copied
    with_guard = guarded.cost_analysis()["bytes accessed"]
    without = unguarded.cost_analysis()["bytes accessed"]
    assert with_guard <= 1.01 * without, (with_guard, without)
