"""Pipeline stages compute the model without them: same losses, gradients and parameters.

Each case trains 3 steps with mesh.stage > 1 and the same 3 steps with one stage (the devices
given to fsdp instead), from the same initial parameters and batches, and compares the loss and
gradient norm of every step and every parameter at the end. The tolerance is float32 rounding:
the pipeline computes each micro-batch's gradient separately and sums them, so sums run in
another order (measured differences after 3 steps: below 5e-7 in the parameters of the dense
cases; up to 2.3e-6 in one element of 8192 of the MoE's dense layer under interleaved 1F1B at
S = 4, an Adam step on a gradient near zero).

The MoE cases run the dropless default (compute.expert_exchange_overflow rounds) inside the
stages with buffers of half the routed rows (compute.expert_exchange_capacity 0.5: every layer
needs at least two rounds, so the rounds' loop and its replayed backward run in every stage),
against one stage whose one round holds the worst case (capacity 8): dropless, the two compute
the same. They train with the Switch balance loss, which the in-schedule tables take per
micro-batch: their reference accumulates gradients over the same 8 micro-batches.
"""

import jax
import numpy as np
import pytest

from maxtrain import config as config_lib
from maxtrain.data import to_global
from maxtrain.data.streams import data_streams
from maxtrain.parallel import pipeline, schedules
from maxtrain.training.trainer import build_trainer

DENSE = [
    "model_name=tiny",
    "model.num_layers=8",
    "data.kind=synthetic",
    "train.global_batch_size=16",
    "train.seq_len=32",
    "optim.warmup_steps=1",
    "checkpoint.enabled=false",
]
MOE = [  # a dense first layer, then 8 MoE layers; experts split over 2 devices in each stage
    "model_name=tiny-moe",
    "model.vocab_size=256",  # every token frequent: no embedding row's Adam step is on rounding
    "model.num_layers=9",
    "model.layers=[global-dense, global-moe*8]",
    "model.mlp_dim=128",
    "model.moe.balance_bias_update_rate=0.01",
    "compute.expert_exchange_capacity=8",  # one round of worst-case buffers: never a second
    *DENSE[2:],
    "train.global_batch_size=64",  # 8 micro-batches (or accumulation steps) over 8 devices
]
STEPS = 3


def train(tmp_path, overrides: list[str]) -> dict:
    """Per step (loss, grad norm, bubble), the MoE layers' exchange counts per step (share of
    assignments dropped, most rounds of any layer; absent for dense models), and the final
    parameters in model order."""
    cfg = config_lib.load(
        config_lib.CONFIGS_DIR / "base.yml", [*overrides, f"run.output_dir={tmp_path}"]
    )
    trainer = build_trainer(cfg)
    batches = data_streams(cfg)[0]
    steps, exchange = [], []
    for _ in range(STEPS):
        batch = to_global(next(batches), trainer.batch_sharding)
        trainer.state, metrics = trainer.step_fn(trainer.state, batch)
        metrics = jax.device_get(metrics)
        steps.append((metrics["loss"], metrics["grad_norm"], metrics.get("pipeline/bubble")))
        exchange.append((metrics.get("moe/dropped"), metrics.get("moe/rounds")))
    params = jax.device_get(trainer.state.params)
    if trainer.saved.layout is not None:  # on the host: no program to compile for it
        params = pipeline.to_model_order(params, trainer.saved.layout)
    return {"steps": steps, "exchange": exchange, "params": params}


# Each model's overrides and its one-stage layout. An in-schedule table (1f1b, interleaved,
# zero bubble) takes the auxiliary loss per micro-batch, as gradient accumulation over as many
# micro-batches does (models/definition.py losses): its MoE cases' reference accumulates over 8.
MODELS = {
    "dense": (DENSE, ["mesh.fsdp=8"]),
    "moe": (MOE, ["mesh.expert=2", "mesh.fsdp=4"]),
    "moe-accumulated": (MOE, ["mesh.expert=2", "mesh.fsdp=4", "train.grad_accum_steps=8"]),
}


@pytest.fixture(scope="module")
def one_stage(tmp_path_factory):
    """The references without a pipeline, each trained once, when a case first needs it."""
    out, done = tmp_path_factory.mktemp("one_stage"), {}

    def reference(model: str) -> dict:
        if model not in done:
            overrides, layout = MODELS[model]
            done[model] = train(out, [*overrides, *layout])
        return done[model]

    return reference


def assert_same_training(got: dict, want: dict) -> None:
    for step, ((loss, norm, _), (want_loss, want_norm, _)) in enumerate(
        zip(got["steps"], want["steps"], strict=True), start=1
    ):
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6, err_msg=f"loss, step {step}")
        np.testing.assert_allclose(norm, want_norm, rtol=1e-5, err_msg=f"grad norm, step {step}")
    for (path, a), b in zip(
        jax.tree.leaves_with_path(got["params"]), jax.tree.leaves(want["params"]), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=5e-6, err_msg=jax.tree_util.keystr(path))


# (model, overrides, stages S, repeats R, micro-batches M): each schedule at S = 2 and 4 with
# M = 8 on the dense model, and (below) on the MoE with expert parallelism and two-round
# exchanges
STAGE_MOE = ["mesh.expert=2", "compute.expert_exchange_capacity=0.5"]
CASES = {
    "gpipe-S2-M8-fsdp-tensor-remat-none": (
        "dense",
        ["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "pipeline.microbatches=8",
         "compute.remat=none"],
        2, 1, 8,
    ),
    "gpipe-S4-M8-tensor-accumulated": (
        "dense",
        ["mesh.stage=4", "mesh.fsdp=1", "mesh.tensor=2", "pipeline.microbatches=8",
         "train.grad_accum_steps=2"],
        4, 1, 8,
    ),
    "circular-S2-R2-M8-unrolled-remat-minimal": (
        "dense",
        ["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "pipeline.schedule=circular",
         "pipeline.repeats=2", "pipeline.microbatches=8", "compute.scan_layers=false",
         "compute.remat=minimal"],
        2, 2, 8,
    ),
    "circular-S4-R2-M8-tensor": (
        "dense",
        ["mesh.stage=4", "mesh.fsdp=1", "mesh.tensor=2", "pipeline.schedule=circular",
         "pipeline.repeats=2", "pipeline.microbatches=8"],
        4, 2, 8,
    ),
    "1f1b-S2-M8-fsdp-tensor": (
        "dense",
        ["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "pipeline.schedule=1f1b",
         "pipeline.microbatches=8"],
        2, 1, 8,
    ),
    "1f1b-S4-M8-tensor": (
        "dense",
        ["mesh.stage=4", "mesh.fsdp=1", "mesh.tensor=2", "pipeline.schedule=1f1b",
         "pipeline.microbatches=8"],
        4, 1, 8,
    ),
    "interleaved_1f1b-S2-R2-M8-fsdp-tensor": (
        "dense",
        ["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "pipeline.schedule=interleaved_1f1b",
         "pipeline.repeats=2", "pipeline.microbatches=8"],
        2, 2, 8,
    ),
    "interleaved_1f1b-S4-R2-M8-tensor": (
        "dense",
        ["mesh.stage=4", "mesh.fsdp=1", "mesh.tensor=2", "pipeline.schedule=interleaved_1f1b",
         "pipeline.repeats=2", "pipeline.microbatches=8"],
        4, 2, 8,
    ),
    "zero_bubble-S2-M8-fsdp-tensor": (
        "dense",
        ["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "pipeline.schedule=zero_bubble",
         "pipeline.microbatches=8"],
        2, 1, 8,
    ),
    "zero_bubble-S4-M8-tensor": (
        "dense",
        ["mesh.stage=4", "mesh.fsdp=1", "mesh.tensor=2", "pipeline.schedule=zero_bubble",
         "pipeline.microbatches=8"],
        4, 1, 8,
    ),
}  # fmt: skip


def moe_case(schedule: str, S: int, R: int) -> tuple:
    """The MoE under `schedule` at S stages (fsdp 4 / S inside a stage, experts split 2 ways),
    M = 8, against the run its objective equals (above)."""
    reference = (
        "moe-accumulated" if schedule in ("1f1b", "interleaved_1f1b", "zero_bubble") else "moe"
    )
    overrides = [f"mesh.stage={S}", f"mesh.fsdp={4 // S}", *STAGE_MOE]
    if schedule != "gpipe":
        overrides.append(f"pipeline.schedule={schedule}")
    if R > 1:
        overrides.append(f"pipeline.repeats={R}")
    return reference, [*overrides, "pipeline.microbatches=8"], S, R, 8


# What the MoE adds inside stages (the exchange's rounds, experts split within a stage, the
# auxiliary loss per micro-batch) does not depend on the stage count, which the dense cases
# cover at 2 and 4 for every schedule: every schedule runs the MoE at S = 2, and the one whose
# table is most intricate (interleaved 1F1B: units of two blocks, ticks of forward and backward
# from different micro-batches) at S = 4 too.
REPEATS = {"gpipe": 1, "circular": 2, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 1}
CASES |= {
    f"moe-{schedule}-S{S}{f'-R{R}' if R > 1 else ''}-M8": moe_case(schedule, S, R)
    for schedule, R in REPEATS.items()
    for S in ((2, 4) if schedule == "interleaved_1f1b" else (2,))
}


def idle_share(schedule: str, S: int, R: int, M: int) -> float:
    """docs/pipeline.md's formulas, each pass over a unit's layers costing alike."""
    if schedule == "zero_bubble":
        return 2 * (S - 1) / (3 * M + 2 * (S - 1))
    return (S - 1) / (R * M + S - 1)


@pytest.mark.parametrize("case", CASES)
def test_stages_train_like_one_stage(tmp_path, one_stage, case):
    model, overrides, stages, repeats, microbatches = CASES[case]
    got = train(tmp_path, [*MODELS[model][0], *overrides])
    want = one_stage(model)
    assert_same_training(got, want)
    schedule = next(part for part in case.split("-") if part in schedules.SCHEDULES)
    bubble = idle_share(schedule, stages, repeats, microbatches)
    assert [b for _, _, b in got["steps"]] == pytest.approx([bubble] * STEPS)
    if model != "dense":  # nothing dropped; the one stage's run needed one round, these more
        assert [d for d, _ in got["exchange"]] == [0] * STEPS
        assert [r for _, r in want["exchange"]] == [1] * STEPS
        assert all(r >= 2 for _, r in got["exchange"]), got["exchange"]


def test_quantized_training_with_stages_follows_the_run_without(tmp_path):
    """int8 training (Qwix, dynamic per-tensor activation scales) with two stages against the
    same without stages. Not equal within rounding: the activations are quantized per
    micro-batch, so the scales differ from the whole batch's. Measured over 3 steps: losses
    within 2.5e-5 (relative), grad norms within 7.3e-4; bounds 1e-3 and 5e-3."""
    int8 = [*DENSE, "quantization.preset=int8"]
    got = train(tmp_path, [*int8, "mesh.stage=2", "mesh.fsdp=4", "pipeline.microbatches=4"])
    want = train(tmp_path, [*int8, "mesh.fsdp=8"])
    for (loss, norm, _), (want_loss, want_norm, _) in zip(got["steps"], want["steps"], strict=True):
        np.testing.assert_allclose(loss, want_loss, rtol=1e-3)
        np.testing.assert_allclose(norm, want_norm, rtol=5e-3)
