"""A hybrid model's layers (models/stacks.py's four kinds) move into pipeline stages and back:
the prologue's dense layers stay in their own stacks, each stack's other layers go into
params["stages"], and to_model_order undoes it."""

import jax
import numpy as np

from maxtrain.models.stacks import ATTENTION_MOE, LINEAR, LINEAR_MOE, STAGES
from maxtrain.parallel.pipeline import StageLayout, to_model_order, to_stages


def test_hybrid_layers_move_into_stages_and_back():
    """10 layers: 2 dense linear-attention ones before the pipeline, then 2 stages x 1 repeat
    of groups [linear MoE x 3, attention MoE]. Each layer's row holds its model index, so where
    each lands can be read off."""
    layout = StageLayout(
        stages=2,
        repeats=1,
        microbatches=2,
        prologue=(LINEAR, LINEAR),
        group=(LINEAR_MOE, LINEAR_MOE, LINEAR_MOE, ATTENTION_MOE),
        attention=(0, 0, 0, 0),
    )
    rows = lambda *layers: {"w": np.asarray(layers, np.float32)[:, None]}
    params = {
        "embedding": np.zeros(3),
        "linear_layers": rows(0, 1),
        "linear_moe_layers": rows(2, 3, 4, 6, 7, 8),
        "moe_layers": rows(5, 9),
    }

    staged = to_stages(params, layout)
    assert set(staged) == {"embedding", "linear_layers", STAGES}
    assert set(staged[STAGES]) == {"linear_moe_layers", "moe_layers"}
    np.testing.assert_array_equal(staged["linear_layers"]["w"][:, 0], [0, 1])
    linear_moe = staged[STAGES]["linear_moe_layers"]["w"]  # [R, S, per group, 1]
    np.testing.assert_array_equal(linear_moe[0, :, :, 0], [[2, 3, 4], [6, 7, 8]])
    np.testing.assert_array_equal(staged[STAGES]["moe_layers"]["w"][0, :, :, 0], [[5], [9]])

    back = to_model_order(staged, layout)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(got, want)
