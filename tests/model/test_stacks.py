"""The layer stacks' helpers over a hybrid model's four kinds of layers, checked against
runs and positions worked out by hand."""

from maxtrain.model.stacks import (
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
