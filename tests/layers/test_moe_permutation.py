"""The MoE's rows move by gathers only, forward and backward, after one sort per layer, its
experts run two grouped matmuls (gate and up in one, then down) and its combine no dot: read
from the compiled train step (maxtrain/analysis/program.py permutation_ops, grouped_matmuls,
dots) of tiny-moe, on one device and with its experts split over 4 simulated devices.

The values these programs compute are held elsewhere: every dispatch against a dense mixture
without permutations (tests/parallel/test_moe_dispatch.py), the layer against a dense
per-token reference and one device against meshes (tests/layers/test_moe.py)."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.analysis.program import dots, grouped_matmuls, permutation_ops
from maxtrain.layers.permutation import Permutation
from maxtrain.training.trainer import build_trainer, compile_step


def test_take_has_the_gradients_of_indexing_and_no_scatter_in_its_backward():
    """A partial permutation of 2 copies of 5 rows into 8 (a slot left out, two rows empty):
    the values and gradients of plain indexing, and the compiled backward has no scatter."""
    destinations = jnp.array([3, 8, 0, 6, 1, 7, 5, 2, 9, 4])  # slot 1 and slot 8: nowhere
    perm = Permutation.to(destinations, 8)
    x = jax.random.normal(jax.random.key(0), (5, 4))
    probe = jax.random.normal(jax.random.key(1), (8, 4))

    def indexed(x):
        rows = jnp.zeros((8, 4)).at[destinations].set(x[np.arange(10) // 2], mode="drop")
        return jnp.sum(rows * probe)

    def gathered(x):
        return jnp.sum(perm.take(x, copies=2) * probe)

    @jax.jit  # one program, not op by op
    def values_and_grads(x):
        back = perm.inverted().take(perm.take(x, copies=2))
        return [(fn(x), jax.grad(fn)(x)) for fn in (gathered, indexed)], back

    ((got, got_grad), (want, want_grad)), back = values_and_grads(x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-6)
    np.testing.assert_allclose(back[1], 0.0)  # left out
    hlo = jax.jit(jax.grad(gathered)).lower(x).compile().as_text()
    assert not [op for op, _ in permutation_ops(hlo) if op == "scatter"]


def _rows(shape: str) -> tuple[str, int, int]:
    """('f32[4,40,64]') -> (dtype, rows, width): an array as rows of its last dimension."""
    dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", shape).groups()
    sizes = [int(d) for d in dims.split(",") if d] or [1]
    return dtype, int(np.prod(sizes[:-1])), sizes[-1]


@pytest.mark.parametrize(
    "devices, mesh",
    [(1, ["mesh.fsdp=1"]), (4, ["mesh.expert=4", "mesh.fsdp=1"])],
    ids=["one-device", "expert4"],
)
def test_train_step_moves_rows_without_scatters_sorts_once_and_runs_two_grouped_matmuls(
    make_cfg, names_in_cache_key, devices, mesh
):
    """tiny-moe's compiled train step (remat full: the forward, its recomputation and the
    backward; the all_to_all exchange's rounds on 4 devices), its experts 24 wide so that the
    widths tell the projections apart (D = 64, 2F = 48):

    * no scatter whose result is at least a device's tokens of width emb, in any pass, and one
      sort per MoE layer (the recomputation reuses the saved order). The embedding's gradient,
      a scatter-add into the [vocab, emb] table, is the one row scatter left, and not the MoE's;
    * two grouped matmuls per MoE layer and exchange round in the forward, [rows, 2F] (gate and
      up) and [rows, D] (down), and no [EL, D, F] weight gradient in the backward (gate's and
      up's come out of one grouped matmul)."""
    cfg = make_cfg("model_name=tiny-moe", "model.moe.expert_mlp_dim=24", *mesh)
    trainer = build_trainer(cfg, devices=jax.devices()[:devices], abstract=True)
    program = compile_step(trainer)[0].as_text()
    ops = permutation_ops(program)
    width, F, layers = cfg.model.emb_dim, cfg.model.moe.expert_mlp_dim, cfg.model.num_layers
    tokens = cfg.train.global_batch_size * cfg.train.seq_len // devices

    def moved_rows(opcode: str) -> dict[str, int]:
        """The opcode's float results of at least a device's tokens as rows of width emb."""
        return {
            shape: n
            for (op, shape), n in ops.items()
            if op == opcode
            and _rows(shape)[0].startswith(("f", "bf"))
            and _rows(shape)[1] >= tokens
            and _rows(shape)[2] == width
        }

    assert moved_rows("scatter") == {f"f32[{cfg.model.vocab_size},{width}]": 1}
    assert sum(n for (op, _), n in ops.items() if op == "sort") == cfg.model.num_layers
    # The rows do move, by gathers (the counter sees into the loops and fusions).
    assert sum(moved_rows("gather").values()) >= 6 * cfg.model.num_layers

    matmuls = grouped_matmuls(program)
    rounds = [False] if devices == 1 else [False, True]  # round 0; the later rounds' loop
    for in_loop in rounds:
        forward = collections.Counter()
        for run, n in matmuls.items():
            if run.forward and run.in_loop == in_loop:
                forward[_rows(run.shape)[2]] += n
        assert forward == {2 * F: layers, width: layers}, matmuls
    experts = cfg.model.moe.num_experts // devices
    assert not [run for run in matmuls if run.shape == f"f32[{experts},{width},{F}]"], matmuls

    # The combine (each token's k outputs, weighted and summed) is element-wise work XLA fuses
    # with the un-permute's gather, in both passes: no dot of depth k over the tokens' rows.
    k = cfg.model.moe.top_k
    combine_dots = [dot for dot, _ in dots(program) if dot.depth == k and dot.shape[0] >= tokens]
    assert not combine_dots, combine_dots
