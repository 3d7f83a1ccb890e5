"""The mixture-of-experts layer against a dense per-token reference, across meshes and modes."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.ragged_all_to_all_reference import emulated_ragged_all_to_all

from maxtrain import config as config_lib
from maxtrain import models as model_lib
from maxtrain.config import ConfigError
from maxtrain.data import to_global
from maxtrain.data.streams import data_streams
from maxtrain.kernels.grouped_matmul import xla_grouped_matmul
from maxtrain.layers import routed_experts
from maxtrain.layers.moe import MoE
from maxtrain.layers.router import router_stats
from maxtrain.layers.spec import ModelSpec
from maxtrain.models.router_training import RouterTraining
from maxtrain.models.stacks import is_moe_per_layer, layer_runs
from maxtrain.parallel.expert_exchanges import Ragged
from maxtrain.parallel.mesh import build_mesh, sharding_rules
from maxtrain.training import metrics
from maxtrain.training.loop import run
from maxtrain.training.trainer import build_trainer

D, E, K, F = 16, 8, 2, 12


def moe_model_cfg(**moe) -> config_lib.ModelConfig:
    settings = dict(num_experts=E, top_k=K, expert_mlp_dim=F) | moe
    return config_lib.ModelConfig(
        vocab_size=32, emb_dim=D, num_layers=1, num_heads=2, moe=config_lib.MoeConfig(**settings)
    )


# GPT-OSS's experts: a router with a bias, biased experts, the clamped SwiGLU (a limit low
# enough that it clips).
GPT_OSS = dict(
    router_logit_bias=True,
    expert_projection_bias=True,
    clamped_swiglu=config_lib.ClampedSwiglu(alpha=1.702, limit=0.7),
)


def make_layer(seed: int = 0, **settings) -> MoE:
    """The layer of model.moe `settings`, computed as the compute.* ones among them say."""
    compute = {k: v for k, v in settings.items() if k in config_lib.ComputeConfig.model_fields}
    moe = {k: v for k, v in settings.items() if k not in compute}
    spec = ModelSpec(
        moe_model_cfg(**moe), config_lib.ComputeConfig(compute_dtype="float32", **compute)
    )
    layer = MoE(spec, rngs=nnx.Rngs(seed))
    # A router with real preferences (the 0.02 init makes routing nearly uniform).
    layer.router.kernel[...] = jax.random.normal(jax.random.key(seed + 1), (D, E))
    if moe.get("expert_projection_bias"):  # biases start at zero; experts of their scale
        keys = iter(jax.random.split(jax.random.key(seed + 2), 7))
        for m in (layer.router.logit_bias, layer.gate.bias, layer.up.bias, layer.down.bias):
            m[...] = jax.random.normal(next(keys), m.shape)
        for m in (layer.gate.kernel, layer.up.kernel, layer.down.kernel):
            m[...] = jax.random.normal(next(keys), m.shape) / math.sqrt(m.shape[1])
    return layer


def apply(module: nnx.Module, x: jax.Array):
    """module(x) compiled as one program: run eagerly, each of its operations would compile a
    program of its own (some 80 for the layer)."""
    graphdef, state = nnx.split(module)
    return jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(state, x)


def reference(
    layer: MoE,
    x: jax.Array,
    keep: np.ndarray | None = None,
    clamped: config_lib.ClampedSwiglu | None = None,
) -> jax.Array:
    """Every expert on every token, then each token's top-k mixed by its weights.

    Routing is recomputed here with numpy (argsort, not lax.top_k); `keep` [N, K] masks
    assignments a capacity limit dropped. Biases where the layer has them and the `clamped`
    SwiGLU, as GPT-OSS states them (transformers' GptOssExperts).
    """
    flat = np.asarray(x.reshape(-1, D), np.float64)
    value = lambda p: 0.0 if p is None else np.asarray(p[...], np.float64)  # noqa: E731
    logits = flat @ np.asarray(layer.router.kernel[...], np.float64) + value(
        layer.router.logit_bias
    )
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :K]
    weights = np.take_along_axis(probs, chosen, -1)
    weights /= weights.sum(-1, keepdims=True)
    if keep is not None:
        weights = weights * keep
    gate, up, down = (
        np.asarray(m.kernel[...], np.float64) for m in (layer.gate, layer.up, layer.down)
    )
    h = np.einsum("nd,edf->nef", flat, gate) + value(layer.gate.bias)
    u = np.einsum("nd,edf->nef", flat, up) + value(layer.up.bias)
    if clamped is None:
        hidden = h / (1 + np.exp(-h)) * u
    else:
        h, u = np.minimum(h, clamped.limit), np.clip(u, -clamped.limit, clamped.limit)
        hidden = (u + 1) * h / (1 + np.exp(-clamped.alpha * h))
    every_expert = np.einsum("nef,efd->ned", hidden, down) + value(layer.down.bias)
    mix = np.zeros((flat.shape[0], E))
    np.put_along_axis(mix, chosen, weights, -1)
    return np.einsum("ne,ned->nd", mix, every_expert).reshape(x.shape), chosen


def test_grouped_matmul_multiplies_each_row_by_its_groups_matrix():
    x = jax.random.normal(jax.random.key(0), (10, 4))
    w = jax.random.normal(jax.random.key(1), (3, 4, 5))
    sizes = jnp.array([4, 0, 3])  # rows 7..9 belong to no group
    out = xla_grouped_matmul(x, w, sizes)
    group = np.repeat([0, 1, 2], np.asarray(sizes))
    expected = np.stack([np.asarray(x[r]) @ np.asarray(w[g]) for r, g in enumerate(group)])
    np.testing.assert_allclose(out[:7], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[7:], 0.0)


@pytest.mark.parametrize("moe", [{}, GPT_OSS], ids=["swiglu", "gpt-oss"])
def test_dropless_forward_matches_the_dense_per_token_reference(moe):
    layer = make_layer(**moe)
    x = jax.random.normal(jax.random.key(2), (2, 8, D))
    y, stats = apply(layer, x)
    expected, _ = reference(layer, x, clamped=moe.get("clamped_swiglu"))
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    assert float(stats["dropped"]) == 0.0
    if moe:  # the clamp clips: some hidden pre-activations pass the limit
        h = np.einsum("btd,edf->btef", x, layer.gate.kernel[...]) + layer.gate.bias[...]
        assert 0.1 < float(np.mean(h > moe["clamped_swiglu"].limit)) < 0.9


@pytest.mark.parametrize("moe", [{}, GPT_OSS], ids=["swiglu", "gpt-oss"])
def test_dropless_gradients_match_the_dense_reference(moe):
    layer = make_layer(**moe)
    x = jax.random.normal(jax.random.key(3), (2, 8, D))
    graphdef, params = nnx.split(layer)
    bias = lambda p: 0.0 if p is None else p[...]  # noqa: E731

    def dense_mixture(params, x):
        """The same function in jnp, with every expert computed for every token."""
        m = nnx.merge(graphdef, params)
        logits = x @ m.router.kernel[...] + bias(m.router.logit_bias)
        probs = jax.nn.softmax(logits, -1)
        top, idx = jax.lax.top_k(probs, K)
        mix = jnp.sum(jax.nn.one_hot(idx, E) * (top / top.sum(-1, keepdims=True))[..., None], -2)
        gate = jnp.einsum("btd,edf->btef", x, m.gate.kernel[...]) + bias(m.gate.bias)
        up = jnp.einsum("btd,edf->btef", x, m.up.kernel[...]) + bias(m.up.bias)
        out = jnp.einsum("btef,efd->bted", m.experts.activation(gate, up), m.down.kernel[...])
        return jnp.einsum("bte,bted->btd", mix, out + bias(m.down.bias))

    def loss(fn):
        return lambda p, x: jnp.sum(jnp.sin(fn(p, x)))

    grad = lambda fn: jax.jit(jax.grad(loss(fn), argnums=(0, 1)))  # noqa: E731
    ours = grad(lambda p, x: nnx.merge(graphdef, p)(x)[0])(params, x)
    theirs = grad(dense_mixture)(params, x)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


# expert_exchange_capacity >= the expert degree: the exchanges' buffers hold the worst case, so
# the sharded layer must equal the single-device one exactly (drops are tested in
# tests/parallel/test_moe_dispatch.py).
NO_DROPS = dict(expert_exchange_capacity=8.0)


@pytest.fixture(scope="module")
def single_device_results():
    """The single-device layer's value and gradients, per model settings and batch: computed
    once, compared with every mesh and exchange of those settings."""
    return {}


@pytest.mark.parametrize(
    "mesh_axes, batch, moe",
    [
        ({"expert": 4, "fsdp": 2}, 8, dict(expert_exchange="all_to_all", **NO_DROPS)),
        ({"expert": 4, "fsdp": 2}, 8, dict(expert_exchange="all_gather", **NO_DROPS)),
        ({"expert": 4, "fsdp": 2}, 8, dict(expert_exchange="ragged", **NO_DROPS)),
        # experts and hidden units split, with each exchange
        ({"expert": 2, "tensor": 2, "fsdp": 2}, 8, dict(expert_exchange="all_to_all", **NO_DROPS)),
        ({"expert": 2, "tensor": 2, "fsdp": 2}, 8, dict(expert_exchange="all_gather", **NO_DROPS)),
        ({"expert": 2, "tensor": 2, "fsdp": 2}, 8, dict(expert_exchange="ragged", **NO_DROPS)),
        ({"data": 2, "fsdp": 4}, 8, {}),  # experts replicated, gathered from FSDP shards
        ({"expert": 4, "fsdp": 2}, 1, {}),  # batch too small to split: tokens replicated
        ({"expert": 4, "fsdp": 2}, 8, dict(expert_capacity_factor=8.0)),  # GShard blocks
        # GPT-OSS's biases: the gate's and up's travel with the experts' hidden units, the
        # down projection's is added once per token whatever splits the hidden units
        (
            {"expert": 2, "tensor": 2, "fsdp": 2},
            8,
            dict(expert_exchange="ragged", **GPT_OSS, **NO_DROPS),
        ),
        ({"expert": 4, "fsdp": 2}, 1, GPT_OSS),
        # Llama 4's weights on the experts' inputs: a row per assignment, sent to its expert
        ({"expert": 2, "tensor": 2, "fsdp": 2}, 8, dict(weight_on="input", **NO_DROPS)),
    ],
)
def test_sharded_layer_equals_the_single_device_result(
    mesh_axes, batch, moe, single_device_results
):
    model_settings = {k: v for k, v in moe.items() if k in {*GPT_OSS, "weight_on"}}
    single_layer = make_layer(**model_settings)
    layer = make_layer(**moe)
    if moe.get("expert_exchange") == "ragged":  # XLA:CPU lacks the op: its documented semantics
        ragged = Ragged(moe["expert_exchange_capacity"], exchange=emulated_ragged_all_to_all)
        layer.experts = dataclasses.replace(layer.experts, dispatch=ragged)
    nnx.update(layer, nnx.state(single_layer))
    x = jax.random.normal(jax.random.key(4), (batch, 8, D))
    rules = config_lib.MeshConfig().rules | {
        "batch": ["data", "fsdp", "expert"],
        "exp": ["expert"],
        "embed": ["fsdp"],
        "mlp": ["tensor"],
    }
    mesh = build_mesh(config_lib.MeshConfig(**{"fsdp": 1, **mesh_axes}))

    def value_and_grads(layer: MoE):
        graphdef, params = nnx.split(layer)

        def f(p, x):
            y, _ = nnx.merge(graphdef, p)(x)
            return jnp.sum(jnp.sin(y)), y

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(params, x)

    with sharding_rules(mesh, rules):
        sharded = value_and_grads(layer)
    key = (repr(model_settings), batch)  # dropless, no mesh: the same for every exchange
    if key not in single_device_results:
        single_device_results[key] = value_and_grads(single_layer)
    single = single_device_results[key]
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_dropless_drops_nothing_when_every_token_wants_one_expert():
    layer = make_layer()
    layer.router.kernel[...] = jnp.zeros((D, E)).at[:, 3].set(5.0)
    x = jnp.abs(jax.random.normal(jax.random.key(5), (2, 8, D)))  # all prefer expert 3
    y, stats = apply(layer, x)
    expected, chosen = reference(layer, x)
    assert (chosen[:, 0] == 3).all()
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    assert float(stats["dropped"]) == 0.0
    assert float(stats["load"][3]) == x.shape[0] * x.shape[1]


def test_capacity_mode_drops_exactly_the_assignments_it_reports():
    factor = 0.75
    layer = make_layer(expert_capacity_factor=factor)
    x = jax.random.normal(jax.random.key(6), (2, 16, D))
    n = x.shape[0] * x.shape[1]
    cap = math.ceil(factor * n * K / E)
    _, chosen = reference(layer, x)
    # Earlier tokens (then earlier of a token's k slots) win a full expert.
    taken = np.zeros(E, int)
    keep = np.zeros((n, K))
    for token in range(n):
        for slot in range(K):
            e = chosen[token, slot]
            keep[token, slot] = taken[e] < cap
            taken[e] += 1
    assert 0 < (1 - keep).sum() < n * K  # the case exercises dropping
    y, stats = apply(layer, x)
    expected, _ = reference(layer, x, keep)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    assert float(stats["dropped"]) == (1 - keep).sum()


def test_router_statistics_match_hand_computation():
    logits = jnp.log(jnp.array([[[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]]]))  # probabilities given
    probs = jax.nn.softmax(logits, -1)
    expert_ids = jnp.array([[[0], [2]]])  # top-1
    stats = router_stats(logits, probs, expert_ids, 3)
    metrics = RouterTraining(moe_model_cfg(num_experts=3, top_k=1).moe).metrics(
        {**jax.tree.map(lambda a: a[None], stats), "dropped": jnp.zeros(1), "rounds": 2 * 2.0},
        jnp.zeros(()),
    )  # one MoE layer, whose exchange took 2 rounds (the statistic is rounds x tokens)
    # f = [1/2, 0, 1/2]; p = [0.4, 0.25, 0.35] -> 3 * (0.2 + 0 + 0.175)
    assert float(metrics["moe/balance_loss"]) == pytest.approx(3 * 0.375, rel=1e-5)
    assert float(metrics["moe/router_z_loss"]) == pytest.approx(0.0, abs=1e-6)  # log(sum p) = 0
    entropy = -np.mean(
        [sum(p * math.log(p) for p in row) for row in [[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]]]
    )
    assert float(metrics["moe/entropy"]) == pytest.approx(entropy, rel=1e-5)
    assert float(metrics["moe/rounds"]) == 2
    np.testing.assert_array_equal(stats["load"], [1, 0, 1])
    assert float(stats["tokens"]) == 2


def test_router_statistics_of_micro_batches_add_up_to_the_whole_batch():
    """Sums over tokens: gradient accumulation and pipeline micro-batches report exactly the
    whole batch's balance loss, which a mean over micro-batches would not."""
    logits = jax.random.normal(jax.random.key(11), (4, 6, E))
    probs = jax.nn.softmax(logits, -1)
    _, expert_ids = jax.lax.top_k(probs, K)
    layer = lambda s: {  # noqa: E731
        **jax.tree.map(lambda a: a[None], s),
        "dropped": jnp.zeros(1),
        "rounds": s["tokens"][None],
    }
    whole = router_stats(logits, probs, expert_ids, E)
    halves = [router_stats(logits[i::2], probs[i::2], expert_ids[i::2], E) for i in (0, 1)]
    summed = jax.tree.map(jnp.add, *halves)
    training = RouterTraining(moe_model_cfg().moe)
    for name, value in training.metrics(layer(whole), jnp.zeros(())).items():
        np.testing.assert_allclose(
            training.metrics(layer(summed), jnp.zeros(()))[name], value, rtol=1e-6, err_msg=name
        )


def _sigmoid_routed_parts(layer, x):
    """In float64 NumPy: the tokens, their sigmoid scores, each token's top-k experts, the
    experts' (gate, up, down) kernels, and the shared expert's output (what the routed ones add
    to)."""
    flat = np.asarray(x.reshape(-1, D), np.float64)
    scores = 1 / (1 + np.exp(-flat @ np.asarray(layer.router.kernel[...], np.float64)))
    chosen = np.argsort(-scores, axis=-1, kind="stable")[:, :K]
    kernels = tuple(
        np.asarray(m.kernel[...], np.float64) for m in (layer.gate, layer.up, layer.down)
    )
    shared = np.asarray(apply(layer.shared, x), np.float64).reshape(-1, D)
    return flat, scores, chosen, kernels, shared


def test_sigmoid_scores_and_shared_expert_are_added_to_the_routed_output():
    layer = make_layer(score="sigmoid", renormalize=False, shared_experts=1, routed_scale=2.0)
    x = jax.random.normal(jax.random.key(7), (1, 4, D))
    y, _ = apply(layer, x)
    flat, scores, chosen, (gate, up, down), expected = _sigmoid_routed_parts(layer, x)
    for n, experts in enumerate(chosen):
        for e in experts:
            h = flat[n] @ gate[e]
            h = h / (1 + np.exp(-h)) * (flat[n] @ up[e])
            expected[n] += 2.0 * scores[n, e] * (h @ down[e])
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("capacity", [None, 8.0], ids=["dropless", "capacity"])
def test_weights_on_the_inputs_scale_what_each_expert_sees(capacity):
    """Llama 4's routing (weight_on input): a token's output is the sum over its k experts of
    SwiGLU_e(w_e x), w_e its sigmoid score, plus the shared expert; not w_e SwiGLU_e(x)."""
    layer = make_layer(
        score="sigmoid",
        renormalize=False,
        shared_experts=1,
        weight_on="input",
        expert_capacity_factor=capacity,
    )
    x = jax.random.normal(jax.random.key(8), (2, 4, D))
    y, stats = apply(layer, x)
    flat, scores, chosen, (gate, up, down), expected = _sigmoid_routed_parts(layer, x)
    for n, experts in enumerate(chosen):
        for e in experts:
            rows = scores[n, e] * flat[n]
            h = rows @ gate[e]
            expected[n] += (h / (1 + np.exp(-h)) * (rows @ up[e])) @ down[e]
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D), expected, rtol=1e-5, atol=1e-5)
    assert float(stats["dropped"]) == 0
    np.testing.assert_array_equal(stats["load"], np.bincount(chosen.reshape(-1), minlength=E))


def test_capacity_helper_rounds_up_and_never_reaches_zero():
    assert routed_experts.capacity(100, 2, 8, 1.0) == 25
    assert routed_experts.capacity(10, 1, 8, 1.0) == 2
    assert routed_experts.capacity(1, 1, 64, 0.1) == 1


def test_layer_schedule_dense_and_moe_layers_as_listed():
    cfg = config_lib.ModelConfig(
        **{
            **moe_model_cfg().model_dump(),
            "num_layers": 6,
            "mlp_dim": 32,
            "layers": ["global-dense*3", "global-moe", "global-dense", "global-moe"],
        }
    )
    assert is_moe_per_layer(cfg) == (False, False, False, True, False, True)
    assert layer_runs(is_moe_per_layer(cfg)) == [
        (False, 0, 3),
        (True, 0, 1),
        (False, 3, 1),
        (True, 1, 1),
    ]
    params = nnx.to_pure_dict(nnx.state(model_lib.abstract(ModelSpec(cfg)), nnx.Param))
    assert params["layers"]["mlp"]["gate"]["kernel"].shape == (4, D, 32)
    assert params["moe_layers"]["moe"]["gate"]["kernel"].shape == (2, E, D, F)


def test_mixed_stack_gives_the_same_logits_scanned_and_unrolled(make_cfg):
    overrides = (
        "model_name=tiny-moe",
        "model.num_layers=4",
        "model.layers=[global-dense, global-moe]",
        "model.mlp_dim=128",
        "mesh.expert=2",
    )
    logits = []
    for scan in ("true", "false"):
        trainer = build_trainer(make_cfg(*overrides, f"compute.scan_layers={scan}"))
        tokens = jnp.arange(64, dtype=jnp.int32).reshape(2, 32) % 256
        with sharding_rules(trainer.mesh, trainer.cfg.mesh.rules):
            out, _, stats = jax.jit(trainer.mdef.apply)(
                trainer.state.params,
                tokens,
                jnp.tile(jnp.arange(32), (2, 1)),
                jnp.ones_like(tokens),
            )
        assert stats["load"].shape == (2, 8)  # layers 1 and 3 are MoE
        logits.append(out)
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_flops_count_active_parameters_only():
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", ["model_name=tiny-moe"]).model
    m = cfg.moe
    attention = 64 * 4 * 16 * 2 + 2 * 64 * 2 * 16  # q, o and k, v
    active_ffn = 64 * m.num_experts + m.top_k * 3 * 64 * m.expert_mlp_dim
    assert metrics.matmul_params(cfg) == 2 * (attention + active_ffn) + cfg.vocab_size * 64
    total = model_lib.param_count(cfg)
    all_experts = 2 * (64 * m.num_experts + m.num_experts * 3 * 64 * m.expert_mlp_dim)
    norms = 2 * 2 * 64 + 64
    assert total == 2 * attention + all_experts + norms + 2 * cfg.vocab_size * 64


def test_tiny_moe_trains_with_expert_parallelism_and_logs_router_health(make_cfg):
    cfg = make_cfg(
        "model_name=tiny-moe",
        "model.vocab_size=256",  # synthetic text over 256 tokens: learnt within 30 steps
        "mesh.expert=4",
        "mesh.fsdp=2",
        "train.steps=30",
        "train.log_every=5",
        "optim.lr=1e-2",
        "optim.warmup_steps=3",
        "model.moe.balance_bias_update_rate=0.01",
    )
    run(cfg)
    lines = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [x["train/loss"] for x in lines if "train/loss" in x]
    assert losses[-1] < 0.7 * losses[0]
    loads = [np.array(x["train/moe/load"]) for x in lines if "train/moe/load" in x]
    assert loads[-1].shape == (2, 8)
    np.testing.assert_allclose(loads[-1].sum(-1), 1.0, rtol=1e-5)
    scalars = [x for x in lines if "train/moe/entropy" in x][-1]
    assert 0 < scalars["train/moe/entropy"] <= math.log(8) + 1e-5
    # 32 tokens per device: 64 routed rows, 20 per peer and round (compute.
    # expert_exchange_capacity 1.25). What overflows while the router is still unbalanced goes
    # in further rounds: none is dropped, at most ceil(4 / 1.25) = 4 rounds.
    logged = [x for x in lines if "train/moe/rounds" in x]
    assert all(x["train/moe/dropped"] == 0 for x in logged)
    assert all(1 <= x["train/moe/rounds"] <= 4 for x in logged)


def test_bias_balancing_moves_load_toward_the_mean(make_cfg):
    cfg = make_cfg("model_name=tiny-moe", "model.moe.balance_bias_update_rate=0.1", "mesh.fsdp=8")
    trainer = build_trainer(cfg)
    before = np.asarray(trainer.state.params["moe_layers"]["moe"]["router"]["bias"])
    batch = to_global(next(data_streams(cfg)[0]), trainer.batch_sharding)
    trainer.state, m = trainer.step_fn(trainer.state, batch)
    after = np.asarray(trainer.state.params["moe_layers"]["moe"]["router"]["bias"])
    share = np.asarray(m["moe/load"])  # [layers, experts], 1/8 each when balanced
    assert (share != 1 / 8).any()
    # Busy experts become less attractive, idle ones more; the optimizer leaves it alone.
    np.testing.assert_allclose(after - before, 0.1 * np.sign(1 / 8 - share), atol=1e-6)


def test_expert_biases_where_assignments_may_drop_are_a_config_error(make_cfg):
    """The down projection's bias is added per routed assignment outside the exchanges, so
    every assignment must be computed."""
    bias = "model.moe.expert_projection_bias=true"
    with pytest.raises(ConfigError, match="expert_projection_bias needs every routed assignment"):
        make_cfg("model_name=tiny-moe", bias, "model.moe.expert_capacity_factor=2")
    with pytest.raises(ConfigError, match="expert_exchange_overflow rounds, not drop"):
        make_cfg("model_name=tiny-moe", bias, "compute.expert_exchange_overflow=drop")


def test_top_k_above_expert_count_is_a_config_error(make_cfg):
    with pytest.raises(
        ConfigError, match=r"model.moe.top_k \(9\) exceeds model.moe.num_experts \(8\)"
    ):
        make_cfg("model_name=tiny-moe", "model.moe.top_k=9")


def test_experts_not_divisible_by_the_expert_axis_is_a_config_error(make_cfg):
    cfg = make_cfg(
        "model_name=tiny-moe", "model.moe.num_experts=12", "mesh.expert=8", "mesh.fsdp=1"
    )
    with pytest.raises(
        ConfigError, match=r"num_experts \(12\) is not divisible by the expert-parallel degree 8"
    ):
        build_trainer(cfg)
    cfg = make_cfg("model_name=tiny-moe", "model.moe.num_experts=6", "mesh.expert=4", "mesh.fsdp=2")
    with pytest.raises(ConfigError, match="degree 4"):
        build_trainer(cfg)
