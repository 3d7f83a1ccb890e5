"""Multi-token prediction (models/mtp.py): its loss against a computation by hand from the same
parameters, its masking at row ends, document boundaries and the data's loss mask, a run in which
it learns, and the sharded and pipelined runs (with group-limited routing) against one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtrain import config as config_lib
from maxtrain import models as model_lib
from maxtrain.data import to_global
from maxtrain.data.streams import data_streams
from maxtrain.parallel import pipeline
from maxtrain.training import metrics, run_model
from maxtrain.training.trainer import build_trainer

T = 16


def packed_batch() -> dict[str, np.ndarray]:
    """Two rows: documents of 7 and 6 tokens then padding; one 16-token document whose loss mask
    skips a prompt (positions 0-3)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 256, (2, T + 1)).astype(np.int32)
    segment_ids = np.array([[1] * 7 + [2] * 6 + [0] * 3, [1] * T], np.int32)
    positions = np.array([list(range(7)) + list(range(6)) + [0] * 3, list(range(T))], np.int32)
    next_same = np.concatenate([segment_ids[:, 1:] == segment_ids[:, :-1], [[False], [True]]], 1)
    loss_mask = (next_same & (segment_ids > 0)).astype(np.int32)
    loss_mask[1, :4] = 0
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": segment_ids,
        "positions": positions,
        "loss_mask": loss_mask,
    }


def rms_norm(x, scale, eps=1e-5):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(scale)


def bound(mdef: model_lib.ModelDef, params) -> nnx.Module:
    """The model object holding `params` (to call its parts)."""
    state = jax.tree.map(lambda v: v, mdef.abstract_state)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(mdef.graphdef, state)


def test_mtp_loss_equals_the_computation_by_hand(make_cfg):
    cfg = make_cfg("model.mtp.depth=2", "model.mtp.loss_weight=0.5")  # tiny, dense, float32
    mdef = run_model.model_def(cfg)
    spec = run_model.model_spec(cfg)
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(model_lib.build(spec), nnx.Param)))()
    b = packed_batch()
    pos, seg = b["positions"], b["segment_ids"]
    out = jax.jit(mdef.apply)(params, b["inputs"], pos, seg, b["targets"], b["loss_mask"])

    # The decoder's layers and each module's block are the model's own (tested elsewhere); the
    # MTP wiring around them is written out here in float64 NumPy.
    layers = jax.jit(lambda p, x: bound(mdef, p)._layers(x, pos, seg)[0])
    block = jax.jit(
        lambda p, x, j: getattr(bound(mdef, p).mtp, f"depth_{j}").block(x, pos, seg)[0],
        static_argnums=2,
    )
    table = np.asarray(params["embedding"], np.float64)
    hidden = layers(params, jnp.asarray(table[b["inputs"]], jnp.float32))
    head = np.asarray(params["lm_head"]["kernel"], np.float64)
    losses = []
    for j in (1, 2):
        p = params["mtp"][f"depth_{j}"]
        ahead = np.zeros((2, T), np.int32)
        ahead[:, : T - j] = b["inputs"][:, j:]
        embedded = table[ahead] * (np.arange(T) < T - j)[None, :, None]  # zeros past the end
        joined = np.concatenate(
            [
                rms_norm(embedded, p["embed_norm"]["scale"]),
                rms_norm(hidden, p["hidden_norm"]["scale"]),
            ],
            -1,
        )
        h = joined @ np.asarray(p["project"]["kernel"], np.float64)
        hidden = block(params, jnp.asarray(h, jnp.float32), j)
        logits = rms_norm(hidden, p["final_norm"]["scale"]) @ head
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        total, count = 0.0, 0
        for row in range(2):
            for t in range(T - j):
                doc = b["segment_ids"][row]
                if doc[t + j] == doc[t] and b["loss_mask"][row, t + j]:
                    total -= log_probs[row, t, b["targets"][row, t + j]]
                    count += 1
        losses.append((total, count))
    # Counted by hand: row 0's documents leave 5 + 4 depth-1 and 4 + 3 depth-2 targets (a
    # target across a boundary or into padding never counts); row 1's masked prompt, 12 each.
    assert [c for _, c in losses] == [21, 19]
    np.testing.assert_array_equal(out.stats["mtp_tokens"], [21, 19])
    np.testing.assert_allclose(out.stats["mtp_nll"], [t for t, _ in losses], rtol=1e-5)
    want_aux = 0.5 * np.mean([t / c for t, c in losses])
    np.testing.assert_allclose(out.aux_loss, want_aux, rtol=1e-5)
    # The next-token logits are the model's without MTP: the modules only add a loss.
    plain = jax.jit(run_model.model_def(make_cfg()).apply)(
        {k: v for k, v in params.items() if k != "mtp"},
        b["inputs"],
        b["positions"],
        b["segment_ids"],
    )
    np.testing.assert_allclose(out.logits, plain.logits, rtol=1e-6, atol=1e-6)


MOE_MTP = [
    "model_name=tiny-mla",  # DeepSeek-style: MLA, a dense first layer, 2 MoE layers; the MTP
    # block is the last layer's kind (MLA and MoE)
    "compute.expert_exchange_capacity=8",  # never drops: the device count must not change routing
    "model.moe.score=sigmoid",  # DeepSeek-V3's routing: 4 groups of 2 experts (with mesh.expert=4
    "model.moe.n_group=4",  # one group per device), a token's 2 experts from its best 2 groups
    "model.moe.topk_group=2",
    "model.mtp.depth=1",
    "compute.remat=none",  # compiles faster; remat is not what is compared
    "data.kind=synthetic",
    "train.global_batch_size=8",
    "train.seq_len=32",
    "optim.lr=1e-2",
    "optim.warmup_steps=1",
    "checkpoint.enabled=false",
]
STEPS = 4


def load(tmp_path, overrides: list[str]) -> config_lib.Config:
    return config_lib.load(
        config_lib.CONFIGS_DIR / "base.yml", [*MOE_MTP, *overrides, f"run.output_dir={tmp_path}"]
    )


def train(tmp_path, overrides: list[str], devices=None) -> dict:
    """Per step (loss, MTP loss, grad norm), and the final parameters in model order."""
    trainer = build_trainer(load(tmp_path, overrides), devices)
    # One global batch, the same on any mesh, learnt by heart: the losses fall within few steps.
    batch = to_global(next(data_streams(load(tmp_path, []))[0]), trainer.batch_sharding)
    steps = []
    for _ in range(STEPS):
        trainer.state, m = trainer.step_fn(trainer.state, batch)
        m = jax.device_get(m)
        steps.append([m["loss"], m["mtp/loss_1"], m["grad_norm"]])
    params = jax.device_get(trainer.state.params)
    if trainer.saved.layout is not None:
        params = pipeline.to_model_order(params, trainer.saved.layout)
    return {"steps": np.array(steps), "params": params}


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return train(tmp_path_factory.mktemp("one"), ["mesh.fsdp=1"], jax.devices()[:1])


def test_mtp_losses_fall(one_device):
    loss, mtp_loss, _ = one_device["steps"].T
    assert mtp_loss[-1] < 0.9 * mtp_loss[0], mtp_loss
    assert loss[-1] < 0.9 * loss[0], loss


# Stages with expert parallelism, the dropless default's exchange rounds inside the stage map
# (the layers) and outside it (the MTP module's MoE block, after the pipeline).
STAGED = ["mesh.stage=2", "mesh.expert=2", "mesh.fsdp=2"]


def test_mtp_on_eight_devices_trains_like_one(tmp_path, one_device):
    """Stages, expert parallelism and fsdp at once (the MTP module's MoE block on the last
    stage, its experts split): the losses and parameters of one device."""
    got = train(tmp_path, STAGED)
    np.testing.assert_allclose(got["steps"], one_device["steps"], rtol=2e-5)
    # Adam divides each gradient element by its running RMS, so an element whose gradient is
    # near zero moves by up to lr (1e-2) whatever its rounding: the parameters agree to 1% of lr.
    for (path, a), b in zip(
        jax.tree.leaves_with_path(got["params"]), jax.tree.leaves(one_device["params"]), strict=True
    ):
        np.testing.assert_allclose(a, b, atol=1e-4, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_flops_and_active_parameters_count_the_modules_as_built(make_cfg, model):
    """The MFU numerator and the active count grow by what the built modules hold: all their
    weights but the norm scales (5 per module) and the idle experts, plus the shared head they
    run again (FLOPs only: it is the decoder's parameter)."""
    plain, with_mtp = (
        make_cfg(f"model_name={model}").model,
        make_cfg(f"model_name={model}", "model.mtp.depth=2").model,
    )
    tree = nnx.to_pure_dict(
        nnx.state(model_lib.abstract(model_lib.ModelSpec(with_mtp)), nnx.Param)
    )["mtp"]
    built = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree))
    m, D = with_mtp.moe, with_mtp.emb_dim
    idle = 2 * (m.num_experts - m.top_k) * 3 * D * m.expert_mlp_dim if m else 0
    active = built - idle
    assert model_lib.param_count(with_mtp) - model_lib.param_count(plain) == built
    assert model_lib.active_param_count(with_mtp) - model_lib.active_param_count(plain) == active
    head = with_mtp.vocab_size * D
    grown = metrics.matmul_params(with_mtp) - metrics.matmul_params(plain)
    assert grown == active - 2 * 5 * D + 2 * head
