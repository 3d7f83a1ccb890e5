"""Group-limited routing (DeepSeek-V3): the router against a direct NumPy statement of the rule,
and the config's one-line refusals."""

import jax
import numpy as np
import pytest
from flax import nnx

from maxtrain import config as config_lib
from maxtrain.config import ConfigError
from maxtrain.layers.moe import MoE
from maxtrain.layers.spec import ModelSpec

D, E, GROUPS, KEEP, K = 8, 16, 4, 2, 3


def grouped_layer() -> MoE:
    cfg = config_lib.ModelConfig(
        vocab_size=32,
        emb_dim=D,
        num_layers=1,
        num_heads=2,
        moe=config_lib.MoeConfig(
            num_experts=E,
            top_k=K,
            expert_mlp_dim=8,
            score="sigmoid",
            routed_scale=2.5,
            balance_bias_update_rate=0.001,
            n_group=GROUPS,
            topk_group=KEEP,
        ),
    )
    compute = config_lib.ComputeConfig(compute_dtype="float32")
    layer = MoE(ModelSpec(cfg, compute), rngs=nnx.Rngs(0))
    layer.router.bias[...] = 0.3 * jax.random.normal(jax.random.key(1), (E,))
    return layer


def numpy_routing(logits: np.ndarray, bias: np.ndarray):
    """The rule as DeepSeek-V3 states it, token by token: groups ranked by the sum of their two
    best biased scores, the best KEEP kept, the top K biased scores among their experts chosen,
    weighted by the unbiased scores renormalised, times the routed scale."""
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    chosen, weights = [], []
    for token_scores in scores:
        select = token_scores + bias
        per_group = select.reshape(GROUPS, E // GROUPS)
        group_score = np.sort(per_group, axis=-1)[:, -2:].sum(-1)
        ranked = np.argsort(-group_score)
        # Well posed: no near-tie at the group boundary for float32 to flip.
        assert group_score[ranked[KEEP - 1]] - group_score[ranked[KEEP]] > 1e-4
        allowed = [e for e in range(E) if e // (E // GROUPS) in ranked[:KEEP]]
        ids = sorted(allowed, key=lambda e: -select[e])[:K]
        w = token_scores[ids] / token_scores[ids].sum()
        chosen.append(ids)
        weights.append(2.5 * w)
    return np.array(chosen), np.array(weights)


def test_group_limited_routing_matches_numpy_rule():
    layer = grouped_layer()
    logits = 2.0 * jax.random.normal(jax.random.key(2), (2, 24, E))
    routing = layer.router.route(logits)
    expert_ids, weights = routing.expert_ids, routing.weights
    chosen, expected = numpy_routing(
        np.asarray(logits).reshape(-1, E), np.asarray(layer.router.bias[...])
    )
    np.testing.assert_array_equal(np.asarray(expert_ids).reshape(-1, K), chosen)
    np.testing.assert_allclose(np.asarray(weights).reshape(-1, K), expected, rtol=1e-5)
    # The limit binds: plain top-k would have picked experts outside the kept groups.
    biased = np.asarray(jax.nn.sigmoid(logits)).reshape(-1, E) + np.asarray(layer.router.bias[...])
    assert (np.argsort(-biased, axis=-1)[:, :K] != chosen).any()
    groups_per_token = [len(set(ids // (E // GROUPS))) for ids in chosen]
    assert max(groups_per_token) <= KEEP


BAD_GROUPS = [
    (["model.moe.n_group=3"], r"num_experts \(8\) is not divisible into model.moe.n_group \(3\)"),
    (
        ["model.moe.n_group=4", "model.moe.topk_group=5"],
        r"topk_group \(5\) exceeds .*n_group \(4\)",
    ),
    (["model.moe.n_group=4", "model.moe.top_k=3"], r"top_k \(3\) exceeds the 2 experts of"),
]


@pytest.mark.parametrize("overrides, message", BAD_GROUPS)
def test_group_settings_that_cannot_route_are_config_errors(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_cfg("model_name=tiny-moe", *overrides)
