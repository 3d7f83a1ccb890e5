"""Checks each grouped-matmul implementation against a float32 reference on this device, and
times it: `python tools/check_grouped_matmul.py [--impl tokamax xla] [--rows M --experts E
...]`.

The default shape is one projection of the H100 MoE recipe: 16k tokens x top-8 = 131072 rows,
64 experts, 1024 -> 512, bf16, with a skewed (not uniform) split of rows over experts. Prints one
JSON line per implementation: relative error of the output and of d(x), d(w), and forward /
forward+backward TFLOP/s counting only the rows' own group (2 * M * K * N forward).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.benchmarks.attention_kernels import rel_err, timed
from maxtrain.kernels.grouped_matmul import IMPLEMENTATIONS


def skewed_group_sizes(rows: int, experts: int, seed: int) -> np.ndarray:
    """Rows per expert drawn from a Zipf-like popularity, summing to `rows` (some may be 0)."""
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, experts + 1) ** 0.8
    assignment = rng.choice(experts, size=rows, p=popularity / popularity.sum())
    return np.bincount(assignment, minlength=experts).astype(np.int32)


def check(impl: str, M: int, E: int, K: int, N: int) -> dict:
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (E, K, N), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    cot = jax.random.normal(keys[2], (M, N), jnp.bfloat16)
    sizes = jnp.asarray(skewed_group_sizes(M, E, 0))

    grouped_matmul = IMPLEMENTATIONS[impl]

    def loss(x, w):
        out = grouped_matmul(x, w, sizes)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

    def reference(x, w):  # float32, each row against its own expert's matrix
        groups = jnp.repeat(jnp.arange(E), sizes, total_repeat_length=M)
        return jnp.einsum("mk,mkn->mn", x.astype(jnp.float32), w.astype(jnp.float32)[groups])

    forward = jax.jit(lambda x, w: grouped_matmul(x, w, sizes))
    both = jax.jit(jax.grad(loss, argnums=(0, 1)))
    ref_out = jax.jit(reference)(x, w)
    ref_grads = jax.jit(
        jax.grad(lambda x, w: jnp.sum(reference(x, w) * cot.astype(jnp.float32)), argnums=(0, 1))
    )(x, w)
    grads = both(x, w)
    flops = 2.0 * M * K * N
    return {
        "impl": impl,
        "device": jax.devices()[0].device_kind,
        "shape": {"rows": M, "experts": E, "in": K, "out": N},
        "out_rel_err": rel_err(forward(x, w), ref_out),
        "dx_rel_err": rel_err(grads[0], ref_grads[0]),
        "dw_rel_err": rel_err(grads[1], ref_grads[1]),
        "fwd_tflops": round(flops / timed(forward, x, w) / 1e12, 1),
        "fwd_bwd_tflops": round(3 * flops / timed(both, x, w) / 1e12, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", nargs="+", default=["tokamax", "xla"])
    parser.add_argument("--rows", type=int, default=131072)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--in-dim", type=int, default=1024)
    parser.add_argument("--out-dim", type=int, default=512)
    args = parser.parse_args(argv)
    for impl in args.impl:
        try:
            result = check(impl, args.rows, args.experts, args.in_dim, args.out_dim)
        except Exception as e:  # a kernel missing on this platform is a result, not a crash
            result = {"impl": impl, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
        print(json.dumps(result), flush=True)
    return 0
