"""Sparse upcycling: the MoE model starts as exactly the dense model, through the library, the
train loop's init.mode=upcycle and tools/upcycle.py on real checkpoints."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtrain import config as config_lib
from maxtrain import models as model_lib
from maxtrain.checkpointing import load_parameters
from maxtrain.checkpointing.export import save_parameters
from maxtrain.config import ConfigError
from maxtrain.data.streams import data_streams
from maxtrain.parallel.mesh import build_mesh
from maxtrain.surgery import cli, upcycle
from maxtrain.surgery.initialize import abstract_params, check_fits, source_config, transform
from maxtrain.surgery.upcycle import check_upcycle
from maxtrain.training import metrics
from maxtrain.training.loop import run
from maxtrain.training.run_model import model_def, model_spec
from maxtrain.training.step import eval_step

FP32 = "compute.compute_dtype=float32"
# Every layer MoE: the model has no dense width (the source's is tiny's 128).
ALL_MOE = "model.mlp_dim=null"
# tiny's dense MLP is 128 wide: top_k slices of 128 / top_k, copied num_experts / top_k times.
MOE_4_OF_8 = ("model.moe={num_experts: 8, top_k: 4, expert_mlp_dim: 32}", ALL_MOE)
MOE_2_OF_8 = ("model.moe={num_experts: 8, top_k: 2, expert_mlp_dim: 64}", ALL_MOE)


def initialised(cfg: config_lib.Config, seed: int = 1) -> dict:
    return nnx.to_pure_dict(nnx.state(model_lib.build(model_spec(cfg), seed), nnx.Param))


def init_params(cfg: config_lib.Config, seed: int = 1) -> dict:
    return jax.jit(lambda: initialised(cfg, seed))()


def upcycled(params: dict, dense: config_lib.Config, moe: config_lib.Config, **options) -> dict:
    """upcycle() compiled as the train loop runs it (one program, not one per operation)."""
    fn = functools.partial(upcycle, dense_cfg=dense.model, moe_cfg=moe.model, **options)
    return jax.jit(fn)(params)


def forward_batch() -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens, positions, segment ids) of one fixed batch: two rows of 32 tokens."""
    tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, 256)
    return tokens, jnp.tile(jnp.arange(32), (2, 1)), jnp.ones_like(tokens)


def forward(cfg: config_lib.Config):
    """params -> (logits, auxiliary loss, router statistics) on one fixed batch, compiled once."""
    batch = forward_batch()
    apply = jax.jit(model_def(cfg).apply)
    return lambda params: apply(params, *batch)


# The ways a zero router weighs the top_k experts, each undone by the down projections:
# (source model, overrides of both models, the MoE's routing). Softmax renormalized to
# 1/top_k, the Kanana shape, is the train-loop test's, below.
VARIANTS = {
    # uniform softmax, not renormalized: 1/num_experts each, times routed_scale
    "softmax-unnormalized-scaled-qk-norm-tied": (
        "tiny-qk",
        (),
        (*MOE_4_OF_8, "model.moe.renormalize=false", "model.moe.routed_scale=2.5"),
    ),
    # sigmoid(0) = 1/2 each, renormalized to 1/top_k; a dense first layer; a balancing bias
    "sigmoid-renormalized-first-dense-bias": (
        "tiny",
        ("model.num_layers=3",),
        (
            MOE_4_OF_8[0],
            "model.moe.score=sigmoid",
            "model.layers=[global-dense, global-moe*2]",
            "model.moe.balance_bias_update_rate=0.01",
        ),
    ),
    # a sliding window every second layer and attention biases: carried as they are
    "softmax-sliding-window-qkv-bias": (
        "tiny",
        (
            "model.layers=[sliding-dense, global-dense]",
            "model.sliding_window=4",
            "model.attention_projection_bias=qkv",
        ),
        (*MOE_4_OF_8, "model.layers=[sliding-moe, global-moe]"),
    ),  # fmt: skip
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_upcycled_model_computes_the_dense_function_at_step_0(make_cfg, variant):
    name, both, routing = VARIANTS[variant]
    dense = make_cfg(f"model_name={name}", FP32, *both)
    moe = make_cfg(f"model_name={name}", FP32, *both, *routing)
    batch = forward_batch()

    @jax.jit  # the dense model's init, its upcycling and both forwards: one program
    def upcycled_and_forwards():
        params = initialised(dense)
        upcycled_params = upcycle(params, dense_cfg=dense.model, moe_cfg=moe.model)
        want = model_def(dense).apply(params, *batch)[0]
        return upcycled_params, want, model_def(moe).apply(upcycled_params, *batch)

    upcycled_params, want, (got, _, stats) = upcycled_and_forwards()
    shape = lambda x: x.shape  # noqa: E731
    assert jax.tree.map(shape, upcycled_params) == jax.tree.map(
        shape, nnx.to_pure_dict(model_def(moe).abstract_state)
    )
    assert sum(x.size for x in jax.tree.leaves(upcycled_params)) == model_lib.param_count(moe.model)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The zero router chose experts 0..top_k-1 for every token: each slice exactly once.
    k = moe.model.moe.top_k
    assert (stats["load"][:, :k] == 2 * 32).all() and (stats["load"][:, k:] == 0).all()


def test_experts_are_copies_of_the_dense_slices_and_noise_breaks_the_symmetry(make_cfg):
    dense, moe = make_cfg(FP32), make_cfg(FP32, *MOE_4_OF_8)
    params = init_params(dense)
    options = ({}, {"noise_std": 0.01, "seed": 3}, {"router_init_std": 0.02})
    exact, noisy, routed = jax.jit(  # the three upcycles compiled as one program
        lambda p: [upcycle(p, dense_cfg=dense.model, moe_cfg=moe.model, **o) for o in options]
    )(params)
    exact = exact["moe_layers"]["moe"]
    gate = np.asarray(params["layers"]["mlp"]["gate"]["kernel"])  # [L, D, 128]
    for e in range(8):  # expert e holds hidden units 32 * (e % 4) .. 32 * (e % 4) + 31
        hidden = slice(32 * (e % 4), 32 * (e % 4) + 32)
        np.testing.assert_array_equal(exact["gate"]["kernel"][:, e], gate[:, :, hidden])
    down = np.asarray(params["layers"]["mlp"]["down"]["kernel"])
    np.testing.assert_array_equal(exact["down"]["kernel"][:, 5], 4 * down[:, 32:64])  # x top_k

    experts = noisy["moe_layers"]["moe"]
    for name in ("gate", "up", "down"):
        w, w0 = np.asarray(experts[name]["kernel"]), np.asarray(exact[name]["kernel"])
        assert not np.array_equal(w[:, 0], w[:, 4])  # two copies of slice 0 now differ
        relative = np.sqrt(np.mean((w - w0) ** 2) / np.mean(w0**2))
        assert 0.005 < relative < 0.02  # noise_std is relative to the weights' RMS
    want, *_ = forward(dense)(params)
    moe_forward = forward(moe)
    got, *_ = moe_forward(noisy)
    assert 1e-4 < np.abs(got - want).max() < 0.1 * np.abs(want).max()

    router = np.asarray(routed["moe_layers"]["moe"]["router"]["kernel"])
    assert 0.015 < router.std() < 0.025
    assert not np.allclose(moe_forward(routed)[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            ("model.moe={num_experts: 9, top_k: 3, expert_mlp_dim: 42}", ALL_MOE),
            "128 is not divisible",
        ),
        (
            ("model.moe={num_experts: 8, top_k: 2, expert_mlp_dim: 32}", ALL_MOE),
            "must be the source's",
        ),
        (
            ("model.moe={num_experts: 6, top_k: 4, expert_mlp_dim: 32}", ALL_MOE),
            "multiple of model.moe",
        ),
        ((*MOE_2_OF_8, "model.moe.shared_experts=1"), "does not support shared experts"),
        (("model.num_layers=3",), "needs a mixture-of-experts target"),
        ((*MOE_2_OF_8, "model.num_layers=3"), "keeps the depth"),
        ((*MOE_2_OF_8, "model.moe.clamped_swiglu={limit: 7}"), "clamped_swiglu is not supported"),
    ],
)
def test_shapes_that_do_not_split_are_config_errors(make_cfg, target, message):
    with pytest.raises(ConfigError, match=message):
        check_upcycle(make_cfg().model, make_cfg(*target).model)


def test_kanana_moe_preset_is_the_nano_model_upcycled(make_cfg):
    """64 experts top-8 of width 8064 / 8, checked on shapes alone (no memory)."""
    cfg = make_cfg(
        "model_name=kanana-moe",
        "init.mode=upcycle",
        "init.source_model=kanana-nano-2.1b",
        "checkpoint.load_parameters_path=unused",
    )
    assert model_lib.param_count(cfg.model) == 11_801_511_680
    assert metrics.matmul_params(cfg.model) == 2_090_532_864  # active per token
    mesh = build_mesh(cfg.mesh)
    source = source_config(cfg)
    produced = jax.eval_shape(
        lambda p: transform(p, source.model, cfg), abstract_params(source, mesh, rules=cfg)
    )
    check_fits(cfg, produced, abstract_params(cfg, mesh))


def read_params(cfg: config_lib.Config, path) -> dict:
    return jax.device_get(load_parameters(path, abstract_params(cfg, build_mesh(cfg.mesh))))


def test_tool_and_train_loop_start_the_moe_from_a_dense_checkpoint(make_cfg, tmp_path):
    """A dense checkpoint on disk -> tools/upcycle.py -> the upcycled parameters on disk;
    and a run with init.mode=upcycle starts at the dense model's loss and trains on."""
    dense = make_cfg(FP32)
    params = init_params(dense)
    source = save_parameters(tmp_path / "dense", params)
    moe_args = (FP32, *MOE_2_OF_8, "init.source_model=tiny")
    moe = make_cfg(*moe_args)

    out = tmp_path / "upcycled"
    base = [str(config_lib.CONFIGS_DIR / "base.yml"), "model_name=tiny", "data.kind=synthetic"]
    argv = [
        *base,
        *moe_args,
        "--source",
        str(source),
        "--output",
        str(out),
    ]
    assert cli.main("upcycle", argv, "upcycle") == 0
    expected = upcycled(params, dense, moe)
    for a, b in zip(jax.tree.leaves(read_params(moe, out)), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    # Its model file names the MoE by path: no copy into configs/models/, no long overrides.
    by_path = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", [f"model_name={out}/model.yml"])
    assert by_path.model.moe == moe.model.moe and by_path.model.emb_dim == moe.model.emb_dim
    assert model_lib.param_count(by_path.model) == model_lib.param_count(moe.model)

    # The train loop, from the dense checkpoint: step 1's loss (before its update) is the
    # dense model's on the same first batch, and training goes on from there.
    first_batch = next(data_streams(dense)[0])
    scored = jax.jit(functools.partial(eval_step, mdef=model_def(dense)))(params, first_batch)
    # (no checkpoints: the losses are what is read)
    run(make_cfg(*moe_args, "init.mode=upcycle", f"checkpoint.load_parameters_path={source}",
                 "train.steps=12", "train.log_every=1", "optim.lr=1e-2",
                 "checkpoint.enabled=false"))  # fmt: skip
    lines = [json.loads(x) for x in (moe.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [x["train/loss"] for x in lines if "train/loss" in x]
    assert losses[0] == pytest.approx(float(scored["nll_sum"] / scored["tokens"]), rel=1e-5)
    assert np.isfinite(losses).all() and np.mean(losses[-3:]) < losses[0] - 0.1


def test_tool_mistakes_are_one_line_and_write_nothing(make_cfg, tmp_path, capsys):
    base = [str(config_lib.CONFIGS_DIR / "base.yml"), "model_name=tiny", "data.kind=synthetic"]
    out = tmp_path / "out"
    cases = {
        "no complete checkpoint found": [*MOE_2_OF_8, "init.source_model=tiny"],
        "needs a mixture-of-experts target": ["init.source_model=tiny"],
        "init.source_model: model_name 'tny'": [*MOE_2_OF_8, "init.source_model=tny"],
    }
    for message, args in cases.items():
        code = cli.main("upcycle", [*base, *args, "--source", str(tmp_path / "none"),
                                    "--output", str(out)], "")  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, err
        assert not out.exists() and list(tmp_path.iterdir()) == []
