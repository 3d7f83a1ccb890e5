"""Muon's matrices dealt over the devices that share them (maxtrain/optim/muon_deal.py), on 8
simulated devices: the same update as one device, each matrix orthogonalised once, the deal's
bytes two all-to-alls of this device's block."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support.optim import apply, muon_cfg

from maxtrain import optim
from maxtrain.analysis import memory
from maxtrain.analysis.collectives import collective_bytes
from maxtrain.analysis.program import matmul_flops

STEPS = 2  # optimizer steps per program
NS_STEPS = 5


def ns_flops(m: int, n: int) -> int:
    """Dot FLOPs of one matrix's Newton-Schulz, on its wide side (s = min, l = max):
    A = X X^T (2 s s l), A A (2 s^3), (b A + c A^2) X (2 s s l), per iteration."""
    s, big = min(m, n), max(m, n)
    return NS_STEPS * (4 * s * s * big + 2 * s**3)


# (mesh axes and shape, {name: (shape, spec, its matrix m x n)}, per-device matrices by shape:
# what one device orthogonalises, all-to-all bytes per device and step: its block out and back)
CASES = {
    "fsdp x tensor, experts split, 3 layers over 4": (
        (("fsdp", "tensor", "expert"), (2, 2, 2)),
        {
            "mlp/up": ((4, 16, 24), P(None, "fsdp", "tensor"), (16, 24)),
            "mlp/down": ((3, 24, 16), P(None, "tensor", "fsdp"), (24, 16)),  # padded to 4
            "attn/q": ((4, 16, 4, 6), P(None, "fsdp", "tensor", None), (16, 24)),  # heads
            "attn/o": ((4, 4, 6, 16), P(None, "tensor", None, "fsdp"), (24, 16)),
            "moe/up": ((2, 4, 16, 8), P(None, "expert", "fsdp", "tensor"), (16, 8)),
        },
        # one matrix of each per device (the experts: 2 layers x 2 own experts over 4)
        {(16, 24): 4, (16, 8): 1},
        # blocks of 384 floats (4 matrices / 4 devices), the experts' 128 (4 x 16 x 8 / 4)
        2 * (4 * 384 + 128) * 4,
    ),
    "stages, fsdp, replicated over data": (
        (("stage", "fsdp", "data"), (2, 2, 2)),
        {
            "mlp/up": ((2, 3, 16, 24), P("stage", None, "fsdp", None), (16, 24)),  # 3 over 2
            "attn/q": ((2, 2, 16, 4, 6), P("stage", None, None, "fsdp", None), (16, 24)),
        },
        {(16, 24): 3},  # 2 of the stage's 3 up matrices (one padding), 1 of its 2 q
        2 * (4 * 192 + 2 * 192) * 4,
    ),
    "fsdp 8": (
        (("fsdp",), (8,)),
        {"mlp/up": ((8, 32, 64), P(None, "fsdp", None), (32, 64))},
        {(32, 64): 1},
        2 * 8 * 32 * 64 // 8 * 4,
    ),
}


def tree(flat: dict) -> dict:
    out: dict = {}
    for name, leaf in flat.items():
        block, kernel = name.split("/")
        out.setdefault("layers", {}).setdefault(block, {}).setdefault(kernel, {})["kernel"] = leaf
    return out


@pytest.mark.parametrize("case", CASES)
def test_dealt_update_equals_the_one_device_update_each_matrix_once(case):
    (names, sizes), leaves, per_device, a2a_bytes = CASES[case]
    rng = np.random.default_rng(0)
    draw = lambda: tree(  # noqa: E731
        {k: rng.standard_normal(s).astype(np.float32) for k, (s, _, _) in leaves.items()}
    )
    params, grads = draw(), [draw() for _ in range(STEPS)]
    cfg = muon_cfg()
    one_tx, _ = optim.build(cfg, 10)
    one = jax.jit(lambda p, gs: apply(one_tx, p, gs)).lower(params, grads).compile()

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(sizes), names)
    shardings = tree({k: NamedSharding(mesh, spec) for k, (_, spec, _) in leaves.items()})
    tx, _ = optim.build(cfg, 10, shardings)
    put = lambda t: jax.device_put(t, shardings)  # noqa: E731
    args = put(params), [put(g) for g in grads]
    dealt = jax.jit(lambda p, gs: apply(tx, p, gs), out_shardings=shardings)
    compiled = dealt.lower(*args).compile()

    for a, b in zip(
        jax.tree.leaves(one(params, grads)), jax.tree.leaves(compiled(*args)), strict=True
    ):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    # Every matrix orthogonalised once in all: one device runs all of them, a device of the
    # mesh only its share.
    every = sum(np.prod(s) // (m * n) * ns_flops(m, n) for s, _, (m, n) in leaves.values())
    assert matmul_flops(one.as_text()) == STEPS * every
    mine = sum(count * ns_flops(*shape) for shape, count in per_device.items())
    assert matmul_flops(compiled.as_text()) == STEPS * mine
    # Only the deal moves bytes: no matrix is gathered whole, no Gram matrix all-reduced.
    assert collective_bytes(compiled.as_text()) == {"all-to-all": STEPS * a2a_bytes}


def test_scratch_is_the_memory_estimate_of_the_compiled_update():
    """16 layers of 512 x 1792 over fsdp 8: each device orthogonalises 2 matrices whole, and
    XLA's buffer assignment for the update holds 2 x 2 of them (the iterate and the next) beside
    its arguments and outputs, as analysis/memory.py's muon_scratch says (within 10%): 16 times
    less than the 16 layers gathered whole, twice."""
    shape = (16, 512, 1792)
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    sharding = NamedSharding(mesh, P(None, "fsdp", None))
    params = tree({"mlp/up": jax.ShapeDtypeStruct(shape, np.float32)})
    shardings = tree({"mlp/up": sharding})
    cfg = muon_cfg()
    tx, _ = optim.build(cfg, 10, shardings)
    state = jax.eval_shape(tx.init, params)
    update = jax.jit(tx.update, in_shardings=(shardings, None, shardings))
    temp = update.lower(params, state, params).compile().memory_analysis().temp_size_in_bytes
    estimate = memory.muon_scratch(shape, sharding.shard_shape(shape), (1, 1), 4)
    assert estimate == 2 * 2 * 512 * 1792 * 4
    assert abs(temp - estimate) <= 0.1 * estimate, (temp, estimate)
