"""Causal self-attention over packed sequences: the kernel a configured name picks, once.

The names, and which backend builds each, are config/attention_kernels.py's table; the
backends are modules of their own: the plain-XLA reference ("xla", xla_attention.py), jax's
splash attention on TPU (splash.py) and tokamax's kernels (tokamax_attention.py).
`attention_kernel(name, window)` returns the function for a name and a layer's sliding window;
the attention layer calls it at construction and keeps the function, so nothing is looked up
by name while tracing. Every kernel skips the work outside the window: the reference's local
layers run `banded_attention` (blocks of `window` queries against two blocks of keys), splash
its LocalMask's block tables, tokamax's flash kernels their k_start ranges. Attention sinks:
the reference and splash have them inside, tokamax's kernels around their forward and backward
(kernels/sinks.py).

A Pallas kernel runs per device on a mesh, inside `shard_map` (parallel/per_device.py); the
reference is plain jnp and is partitioned like any other op.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax

from maxtrain.config.attention_kernels import ATTENTION_CHOICES, ATTENTION_KERNELS, AUTO
from maxtrain.kernels import splash, tokamax_attention
from maxtrain.kernels.xla_attention import banded_attention, reference_attention
from maxtrain.parallel.per_device import per_device

type AttentionFn = Callable[..., jax.Array]  # (q, k, v, segment_ids, sinks=None) -> output


def _xla(kernel: str, window: int | None) -> AttentionFn:
    return reference_attention if window is None else partial(banded_attention, window=window)


def _splash(kernel: str, window: int | None) -> AttentionFn:
    return per_device(partial(splash.splash_attention, window=window))


def _tokamax(kernel: str, window: int | None) -> AttentionFn:
    return per_device(tokamax_attention.tokamax_attention(kernel, window))


# backend module -> (the backend's name for a kernel, window) -> the attention function
_BUILDERS: dict[str, Callable[[str, int | None], AttentionFn]] = {
    "xla": _xla,
    "splash": _splash,
    "tokamax": _tokamax,
}
# backend module -> what its kernels' calls are named in a compiled program, by the backend's
# name for a kernel (the plain-XLA reference calls none)
_PROGRAM_CALLS: dict[str, dict[str, str]] = {
    "splash": {"": splash.PROGRAM_CALL},
    "tokamax": tokamax_attention.PROGRAM_CALLS,
}


def attention_implementation(name: str, platform: str | None = None) -> str:
    """The kernel a configured name means on `platform`, that of the devices the program is
    built for (None: this process's default backend): "auto" is splash attention on TPU
    (kernels/splash.py), tokamax's Mosaic flash kernel on GPU and the reference ("xla")
    elsewhere; "mosaic" is tokamax's "mosaic_<platform>". Raises ValueError for a name that is
    no kernel."""
    platform = platform or jax.default_backend()
    if name == "auto":
        return AUTO.get(platform, "xla")
    if name == "mosaic":
        return f"mosaic_{platform}"
    if name not in ATTENTION_KERNELS:
        raise ValueError(
            f"unknown attention implementation {name!r}; valid: {', '.join(ATTENTION_CHOICES)}"
        )
    return name


def attention_kernel(name: str, window: int | None = None, max_logit: bool = False) -> AttentionFn:
    """The attention function a configured name picks, chosen once (layers store it):
    (q, k [B, T, N|K, H], v [B, T, K, Hv], segment_ids [B, T], sinks [N] | None) -> [B, T, N, Hv]
    in q.dtype, causal within packed documents (and within the last `window` keys), scale
    1/sqrt(H); N % K == 0, query head n uses kv head n // G; Hv <= H.

    With `max_logit`, the function returns (output, each query's largest logit [B, T, N]):
    only the plain-XLA kernel gives it (the fused kernels keep their scores to themselves), so
    any other name raises ValueError (the config refuses it first: compute.attention_max_logit)."""
    resolved = attention_implementation(name)
    if max_logit:
        if resolved != "xla":
            raise ValueError(f"the attention's max logit needs the xla kernel, not {resolved!r}")
        return partial(_xla("", window), max_logit=True)
    if resolved not in ATTENTION_KERNELS:  # "mosaic" on a platform it has no kernel for
        return _unavailable(name, jax.default_backend())
    backend = ATTENTION_KERNELS[resolved]
    return _BUILDERS[backend.module](backend.kernel, window)


def program_call(name: str) -> str | None:
    """A regular expression of the names the calls of kernel `name` (a concrete one) have in a
    compiled program (analysis/program.py kernels), or None for the plain-XLA ones."""
    backend = ATTENTION_KERNELS.get(name)
    if backend is None:
        return None
    return _PROGRAM_CALLS.get(backend.module, {}).get(backend.kernel)


def _unavailable(name: str, backend: str) -> AttentionFn:
    """Stands in for a kernel this backend cannot run. Raising when called rather than when the
    model is built lets a CPU host still build (and dry-run) a GPU/TPU recipe's model."""

    def fn(q, k, v, segment_ids, sinks=None):
        raise NotImplementedError(f"{name!r} attention needs a gpu or tpu backend, not {backend}")

    return fn
