"""The layer stacks' helpers over a hybrid model's four kinds of layers, checked against
runs and positions worked out by hand."""

import jax.numpy as jnp
import numpy as np

from maxtrain.models.stacks import (
    ATTENTION,
    ATTENTION_MOE,
    LINEAR,
    LINEAR_MOE,
    STACKS,
    layer_runs,
    stack_members,
    stack_positions,
)

# Qwen3-Next's pattern (three linear-attention layers, then one attention layer), every layer
# MoE but the 2 leading dense ones.
QWEN3_NEXT = (
    LINEAR, LINEAR, LINEAR_MOE, ATTENTION_MOE,
    LINEAR_MOE, LINEAR_MOE, LINEAR_MOE, ATTENTION_MOE,
)  # fmt: skip
# All four kinds: 4 leading dense layers, so that one dense layer attends.
ALL_FOUR = (
    LINEAR, LINEAR, LINEAR, ATTENTION,
    LINEAR_MOE, LINEAR_MOE, LINEAR_MOE, ATTENTION_MOE,
)  # fmt: skip


def test_stacks_have_their_checkpoint_keys():
    assert STACKS == {
        ATTENTION: "layers",
        ATTENTION_MOE: "moe_layers",
        LINEAR: "linear_layers",
        LINEAR_MOE: "linear_moe_layers",
    }
    assert ATTENTION == ("attention", False) and LINEAR_MOE == ("linear", True)


def test_qwen3_next_pattern_in_runs_and_stack_positions():
    assert layer_runs(QWEN3_NEXT) == [
        (LINEAR, 0, 2),
        (LINEAR_MOE, 0, 1),
        (ATTENTION_MOE, 0, 1),
        (LINEAR_MOE, 1, 3),
        (ATTENTION_MOE, 1, 1),
    ]
    assert stack_positions(QWEN3_NEXT) == [0, 1, 0, 0, 1, 2, 3, 1]
    assert stack_members(QWEN3_NEXT) == {
        LINEAR: [0, 1],
        LINEAR_MOE: [2, 4, 5, 6],
        ATTENTION_MOE: [3, 7],
    }


def test_all_four_kinds_in_runs_and_stack_positions():
    assert layer_runs(ALL_FOUR) == [
        (LINEAR, 0, 3),
        (ATTENTION, 0, 1),
        (LINEAR_MOE, 0, 3),
        (ATTENTION_MOE, 0, 1),
    ]
    assert stack_positions(ALL_FOUR) == [0, 1, 2, 0, 0, 1, 2, 0]
    assert stack_members(ALL_FOUR) == {
        LINEAR: [0, 1, 2],
        ATTENTION: [3],
        LINEAR_MOE: [4, 5, 6],
        ATTENTION_MOE: [7],
    }


def test_routing_bias_moves_in_each_moe_stack_by_its_own_layers_load():
    """A hybrid model's MoE layers live in two stacks (linear attention's, attention's): the
    aux-loss-free bias of each layer moves by that layer's load, found by its row among the
    MoE layers' statistics (model order), not by its position in another stack."""
    from maxtrain.config import ModelConfig, MoeConfig
    from maxtrain.models.router_training import RouterTraining, moe_rows_per_stack

    cfg = ModelConfig(
        vocab_size=16, emb_dim=8, num_layers=4, num_heads=2, num_kv_heads=1,
        layers=["linear-moe", "global-moe"],
        linear_attention={"num_key_heads": 1, "num_value_heads": 2},
        moe=MoeConfig(num_experts=2, top_k=1, expert_mlp_dim=4, balance_bias_update_rate=0.5),
    )  # fmt: skip
    rows = moe_rows_per_stack(cfg)
    assert rows == (("linear_moe_layers", (0, 2)), ("moe_layers", (1, 3)))
    # Layer i's load: expert 0 busier in layers 0 and 3, expert 1 in layers 1 and 2.
    load = jnp.asarray([[3.0, 1.0], [1.0, 3.0], [0.0, 4.0], [4.0, 0.0]])
    zeros = {"moe": {"router": {"bias": jnp.zeros((2, 2))}}}
    params = {"linear_moe_layers": zeros, "moe_layers": zeros}
    moved = RouterTraining(cfg.moe, rows).after_update(params, params, {"load": load})
    # The busier expert's bias falls by 0.5, the idler's rises by 0.5.
    np.testing.assert_array_equal(
        moved["linear_moe_layers"]["moe"]["router"]["bias"], [[-0.5, 0.5], [0.5, -0.5]]
    )
    np.testing.assert_array_equal(
        moved["moe_layers"]["moe"]["router"]["bias"], [[0.5, -0.5], [-0.5, 0.5]]
    )
