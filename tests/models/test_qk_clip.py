"""QK-clip (models/qk_clip.py): the rescale against a NumPy statement of the rule (grouped-query
and latent attention), the max-logit statistic against brute force, a train step that clips
exactly what it says and one that does not clip changing nothing, and the refusals."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.numerics import synthetic_batch

from maxtrain.config import CONFIGS_DIR, ConfigError, load
from maxtrain.data import to_global
from maxtrain.kernels.xla_attention import (
    banded_attention,
    head_max_logit,
    reference_attention,
)
from maxtrain.models.qk_clip import MAX_LOGIT, QKClip
from maxtrain.training.loop import build_trainer
from maxtrain.training.run_model import build_model, for_platform, model_def

BASE = CONFIGS_DIR / "base.yml"
TAU = 1.0
# Per row (attention layer in model order) and query head: below, at and above tau.
MAX_LOGITS = np.array([[3.0, 0.5, 1.5, 2.0], [0.2, 0.3, 5.0, 1.0], [4.0, 4.0, 0.9, 1.25]])


def factors(s):
    return np.where(s > TAU, TAU / s, 1.0)


def test_gqa_rule_scales_every_head_logit_by_its_own_factor():
    """Two stacks whose layers are rows (0, 2) and (1,) of the statistics; 4 query heads over
    2 key heads. Stated in NumPy: key head j times sqrt(min gamma of its group), query head h
    times gamma_h / that; biases alike. So every logit (x Wq + bq) . (x Wk + bk) of head h
    is gamma_h times what it was: checked on random x, and nothing else changes."""
    rng = np.random.default_rng(0)
    L, D, N, K, H = 2, 8, 4, 2, 3
    proj = lambda *shape: {
        "kernel": rng.normal(size=(L, D, *shape)),
        "bias": rng.normal(size=(L, *shape)),
    }  # noqa: E731
    params = {
        stack: {
            "attn": {"q": proj(N, H), "k": proj(K, H), "v": proj(K, H)},
            "mlp_norm": {"scale": rng.normal(size=(L, D))},
        }
        for stack in ("layers", "moe_layers")
    }
    params["moe_layers"] = jax.tree.map(lambda x: x[:1], params["moe_layers"])
    params = jax.tree.map(lambda x: x.astype(np.float32), params)
    clip = QKClip(TAU, (("layers", (0, 2)), ("moe_layers", (1,))), K, None)
    out = jax.device_get(jax.jit(clip)(params, {MAX_LOGIT: jnp.asarray(MAX_LOGITS, jnp.float32)}))

    x = rng.normal(size=(5, D)).astype(np.float32)
    for stack, rows in (("layers", [0, 2]), ("moe_layers", [1])):
        gamma = factors(MAX_LOGITS[rows])  # [L, N]
        key = np.sqrt(gamma.reshape(-1, K, N // K).min(-1))  # [L, K]
        query = gamma / np.repeat(key, N // K, axis=1)
        old, new = params[stack]["attn"], out[stack]["attn"]
        for name, s in (("q", query), ("k", key)):
            np.testing.assert_allclose(
                new[name]["kernel"], old[name]["kernel"] * s[:, None, :, None], rtol=1e-6
            )
            np.testing.assert_allclose(
                new[name]["bias"], old[name]["bias"] * s[..., None], rtol=1e-6
            )

        def logits(a):  # [L, N, S, S] of x
            q = np.einsum("sd,ldnh->lsnh", x, a["q"]["kernel"]) + a["q"]["bias"][:, None]
            k = np.einsum("sd,ldkh->lskh", x, a["k"]["kernel"]) + a["k"]["bias"][:, None]
            return np.einsum("lsnh,ltnh->lnst", q, np.repeat(k, N // K, axis=2))

        np.testing.assert_allclose(
            logits(new), logits(old) * gamma[..., None, None], rtol=1e-4, atol=1e-5
        )
        np.testing.assert_array_equal(new["v"]["kernel"], old["v"]["kernel"])
        np.testing.assert_array_equal(
            out[stack]["mlp_norm"]["scale"], params[stack]["mlp_norm"]["scale"]
        )


def test_mla_rule_is_kimi_k2s():
    """MLA (arXiv 2507.20534 sec. 2.1): q_nope and kv_b's k_nope columns times sqrt(gamma),
    q_rope times gamma; kv_b's value columns, kv_a (the shared k_rope) and o untouched."""
    rng = np.random.default_rng(1)
    L, R, N, nope, rope, V = 3, 6, 4, 5, 2, 3
    attn = {
        "q_a": {"kernel": rng.normal(size=(L, 8, R))},
        "q_b": {"kernel": rng.normal(size=(L, R, N, nope + rope))},
        "kv_a": {"kernel": rng.normal(size=(L, 8, R + rope))},
        "kv_b": {"kernel": rng.normal(size=(L, R, N, nope + V))},
    }
    params = {"layers": {"attn": jax.tree.map(lambda x: x.astype(np.float32), attn)}}
    clip = QKClip(TAU, (("layers", (0, 1, 2)),), N, (nope, rope))
    stats = {MAX_LOGIT: jnp.asarray(MAX_LOGITS)}
    out = jax.device_get(jax.jit(clip)(params, stats))["layers"]["attn"]
    old = params["layers"]["attn"]
    gamma = factors(MAX_LOGITS)[:, None, :]  # [L, 1 (the input dim), N]
    q, kv = old["q_b"]["kernel"], old["kv_b"]["kernel"]
    np.testing.assert_allclose(
        out["q_b"]["kernel"][..., :nope], q[..., :nope] * np.sqrt(gamma)[..., None], rtol=1e-6
    )
    np.testing.assert_allclose(
        out["q_b"]["kernel"][..., nope:], q[..., nope:] * gamma[..., None], rtol=1e-6
    )
    np.testing.assert_allclose(
        out["kv_b"]["kernel"][..., :nope], kv[..., :nope] * np.sqrt(gamma)[..., None], rtol=1e-6
    )
    np.testing.assert_array_equal(out["kv_b"]["kernel"][..., nope:], kv[..., nope:])
    for name in ("q_a", "kv_a"):
        np.testing.assert_array_equal(out[name]["kernel"], old[name]["kernel"])


def brute_force_max(q, k, segment_ids, window=None):
    """Each query head's largest visible logit, padding queries (segment 0) left out."""
    b, t, n, h = q.shape
    g = n // k.shape[2]
    best = np.full(n, -np.inf)
    for i, j in np.ndindex(b, t):
        if segment_ids[i, j] == 0:
            continue
        for s in range(j + 1):
            if segment_ids[i, s] != segment_ids[i, j] or (window and j - s >= window):
                continue
            for head in range(n):
                best[head] = max(best[head], q[i, j, head] @ k[i, s, head // g] / np.sqrt(h))
    return best


@pytest.mark.parametrize("window", [None, 3])
def test_xla_kernel_max_logit_is_the_largest_visible_logit(window):
    """Two packed documents and trailing padding, GQA (4 heads over 2), whole and banded."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.normal(size=(2, 9, heads, 4)).astype(np.float32) for heads in (4, 2, 2))
    segment_ids = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 0, 0]], np.int32)
    q[segment_ids == 0] *= 100  # padding queries with huge logits: never counted
    attend = reference_attention if window is None else banded_attention
    kw = {} if window is None else {"window": window}
    plain = jax.jit(partial(attend, **kw))(q, k, v, segment_ids)  # compiled, not op by op
    out, row_max = jax.jit(partial(attend, max_logit=True, **kw))(q, k, v, segment_ids)
    np.testing.assert_array_equal(out, plain)
    max_logit = jax.jit(head_max_logit)(row_max, segment_ids)
    np.testing.assert_allclose(max_logit, brute_force_max(q, k, segment_ids, window), rtol=1e-5)


TINY = [
    "model_name=tiny", "model.num_layers=1", "data.kind=synthetic", "train.global_batch_size=8",
    "train.seq_len=32", "mesh.fsdp=1", "train.grad_accum_steps=2", "optim.lr=0",
]  # fmt: skip


def one_step(tmp_path, *overrides):
    """The tiny model's first train step (two micro-batches, learning rate 0: the update
    changes nothing, so whatever changes is the clip): (params before, after, metrics, cfg)."""
    cfg = load(BASE, [*TINY, f"run.output_dir={tmp_path}", *overrides])
    trainer = build_trainer(cfg, devices=jax.devices()[:1])
    before = jax.device_get(trainer.state.params)
    batch = to_global(synthetic_batch(cfg), trainer.batch_sharding)
    state, metrics = trainer.step_fn(trainer.state, batch)
    return before, jax.device_get(state.params), jax.device_get(metrics), cfg, trainer


def test_a_step_clips_each_head_to_tau_and_without_clipping_changes_nothing(tmp_path):
    """The step's max logit is the largest over both micro-batches (maxed, not summed: the
    whole batch's, from the model's forward); after the step, on the same batch, each head's
    max logit is min(S_h, tau) (lr 0: only the clip moved the weights). A threshold no logit
    reaches leaves the step bit for bit what it is without the key."""
    plain_before, plain_after, plain_metrics, _, _ = one_step(tmp_path / "plain")
    assert "attention/max_logit" not in plain_metrics
    high_before, high_after, high_metrics, _, _ = one_step(
        tmp_path / "high", "optim.qk_clip_threshold=1e6"
    )
    for a, b in zip(jax.tree.leaves(high_after), jax.tree.leaves(plain_after), strict=True):
        np.testing.assert_array_equal(a, b)
    assert high_metrics["loss"] == plain_metrics["loss"]

    before, after, metrics, cfg, trainer = one_step(
        tmp_path / "low", "optim.qk_clip_threshold=0.075"
    )
    mdef = trainer.mdef
    batch = synthetic_batch(cfg)
    apply = jax.jit(
        lambda p: mdef.apply(p, batch["inputs"], batch["positions"], batch["segment_ids"]).stats
    )
    s_before, s_after = (np.asarray(apply(p)[MAX_LOGIT]) for p in (before, after))  # [1, N]
    assert metrics["attention/max_logit"] == pytest.approx(s_before.max(), rel=1e-6)
    clipped = (s_before > 0.075).reshape(2, 2)  # [K, G]
    assert (
        clipped.any(-1).all() and not clipped.all(-1).any()
    )  # in both key heads' groups, some query heads clip and some do not
    np.testing.assert_allclose(s_after, np.minimum(s_before, 0.075), rtol=1e-5)


def test_mla_model_first_layer_clips_to_tau(tmp_path):
    """tiny-mla (q_a/q_b queries, a dense and an MoE layer): the statistics hold both attention
    layers beside the router's, and the rescale on the model's own parameter names brings the
    first layer's heads (whose input the clip does not change) to min(S_h, tau)."""
    overrides = [
        "model_name=tiny-mla", "model.num_layers=2", "data.kind=synthetic", "train.seq_len=16",
        "optim.qk_clip_threshold=0.05", f"run.output_dir={tmp_path}",
    ]  # fmt: skip
    cfg = load(BASE, overrides)
    mdef = model_def(cfg)
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(build_model(cfg), nnx.Param)))()
    batch = synthetic_batch(cfg)
    apply = jax.jit(
        lambda p: mdef.apply(p, batch["inputs"], batch["positions"], batch["segment_ids"]).stats
    )
    stats = apply(params)
    assert stats[MAX_LOGIT].shape == (2, cfg.model.num_heads) and "load" in stats
    s_before = np.asarray(stats[MAX_LOGIT])
    assert (s_before[0] > 0.05).any()
    s_after = np.asarray(apply(jax.jit(mdef.after_update)(params, params, stats))[MAX_LOGIT])
    np.testing.assert_allclose(s_after[0], np.minimum(s_before[0], 0.05), rtol=1e-5)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["compute.attention=splash"],
         "compute.attention=xla computes, not compute.attention=splash"),
        (["model.qk_norm=rms"], "model.qk_norm=rms"),
        (["mesh.context=2"], "mesh.context=1"),
        (["mesh.stage=2"], "pipeline stages"),
    ],
)  # fmt: skip
def test_refused_where_it_cannot_see_or_move_the_logits(overrides, expected):
    with pytest.raises(ConfigError, match="optim.qk_clip_threshold=0.5") as e:
        load(BASE, ["model_name=tiny", "optim.qk_clip_threshold=0.5", *overrides])
    assert expected in str(e.value)


def test_auto_attention_on_tpu_is_refused_once_the_platform_is_known():
    cfg = load(BASE, ["model_name=tiny", "optim.qk_clip_threshold=0.5"])
    for_platform(cfg, "cpu")  # auto is xla there
    with pytest.raises(ConfigError, match="optim.qk_clip_threshold.*compute.attention=xla"):
        for_platform(cfg, "tpu")
