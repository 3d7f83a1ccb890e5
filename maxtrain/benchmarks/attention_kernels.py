"""Checks each attention implementation against the plain-jnp reference on this device, and
times it: `python tools/check_kernels.py [--impl mosaic cudnn ...] [--window W]
[--sinks]`.

Inputs are bf16 with several packed documents per row; the reference runs in float32 on the same
inputs. Prints one JSON line per implementation: relative error of the output and of dq/dk/dv
(and d_sinks with --sinks) (||x - ref|| / ||ref||), and forward / forward+backward TFLOP/s
(causal FLOPs, counted half; with a window, over the keys it reaches).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.kernels.attention import attention_kernel
from maxtrain.kernels.xla_attention import reference_attention


def packed_segments(batch: int, seq: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = np.zeros((batch, seq), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq), size=3, replace=False))
        ids[b] = np.searchsorted(cuts, np.arange(seq), side="right") + 1
    return ids


def timed(fn, *args, iters: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def check(
    impl: str, B: int, T: int, N: int, K: int, H: int, window: int | None, with_sinks: bool
) -> dict:
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (B, T, N, H), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, K, H), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, K, H), jnp.bfloat16)
    cot = jax.random.normal(keys[3], (B, T, N, H), jnp.bfloat16)
    seg = jnp.asarray(packed_segments(B, T, 0))
    sinks = 2.0 * jax.random.normal(keys[4], (N,), jnp.float32) if with_sinks else None
    argnums = (0, 1, 2, 3) if with_sinks else (0, 1, 2)

    def loss(fn, q, k, v, sinks):
        return jnp.sum(fn(q, k, v, seg, sinks).astype(jnp.float32) * cot.astype(jnp.float32))

    fast = attention_kernel(impl, window)
    ref = lambda q, k, v, s, sinks: reference_attention(  # noqa: E731
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), s, sinks,
        window=window,
    )  # fmt: skip
    fwd = jax.jit(fast)
    grad = jax.jit(jax.grad(lambda *a: loss(fast, *a), argnums=argnums))
    ref_out = jax.jit(ref)(q, k, v, seg, sinks)
    ref_grads = jax.jit(jax.grad(lambda *a: loss(ref, *a), argnums=argnums))(q, k, v, sinks)
    out, grads = fwd(q, k, v, seg, sinks), grad(q, k, v, sinks)
    reach = T if window is None else min(window, T)
    flops = 2 * 2 * B * T * N * H * (reach - reach * reach / (2 * T))  # QK^T and PV, causal
    t_fwd, t_bwd = timed(fwd, q, k, v, seg, sinks), timed(grad, q, k, v, sinks)
    return {
        "impl": impl,
        "shape": [B, T, N, K, H],
        "window": window,
        "sinks": with_sinks,
        "out_rel_err": rel_err(out, ref_out),
        "grads_rel_err": [rel_err(g, r) for g, r in zip(grads, ref_grads, strict=True)],
        "fwd_ms": round(t_fwd * 1e3, 3),
        "fwd_tflops": round(flops / t_fwd / 1e12, 1),
        "fwd_bwd_ms": round(t_bwd * 1e3, 3),
        "fwd_bwd_tflops": round(3.5 * flops / t_bwd / 1e12, 1),  # bwd ~2.5x fwd matmuls
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", nargs="+", default=["xla", "mosaic", "cudnn"])
    parser.add_argument(
        "--shape",
        nargs=5,
        type=int,
        default=[8, 2048, 32, 8, 64],
        metavar=("B", "T", "N", "K", "H"),
    )
    parser.add_argument("--window", type=int, default=None, help="a sliding window of W keys")
    parser.add_argument("--sinks", action="store_true", help="with an attention sink per head")
    args = parser.parse_args(argv)
    for impl in args.impl:
        try:
            print(json.dumps(check(impl, *args.shape, args.window, args.sinks)), flush=True)
        except Exception as e:  # report and go on: one missing kernel must not hide the others
            print(json.dumps({"impl": impl, "error": f"{type(e).__name__}: {e}"[:500]}), flush=True)
    return 0
