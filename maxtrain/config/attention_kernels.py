"""The attention kernels by name: the one table that `compute.attention` is validated against
(compute.py), that kernels/attention.py builds each kernel from and that analysis/program.py
looks for in a compiled program.

It lives in config, not kernels, because the config must know the names and may import no
kernel (docs/architecture.md: config comes before kernels), while kernels may read config.
Each name says which backend module of kernels/ builds it and what that backend calls it, so
no other module lists the names again.
"""

from __future__ import annotations

from typing import Literal, NamedTuple


class AttentionBackend(NamedTuple):
    """Which kernels/ module builds a kernel (xla: xla_attention.py, splash: splash.py,
    tokamax: tokamax_attention.py), and the backend's own name for it (tokamax's)."""

    module: Literal["xla", "splash", "tokamax"]
    kernel: str = ""


ATTENTION_KERNELS: dict[str, AttentionBackend] = {
    "xla": AttentionBackend("xla"),  # the plain-XLA reference, any platform
    "splash": AttentionBackend("splash"),  # TPU: jax's splash attention
    "mosaic_gpu": AttentionBackend("tokamax", "mosaic_gpu"),  # tokamax's Mosaic flash kernels
    "mosaic_tpu": AttentionBackend("tokamax", "mosaic_tpu"),
    "cudnn": AttentionBackend("tokamax", "cudnn"),
    "triton": AttentionBackend("tokamax", "triton"),
    "xla_chunked": AttentionBackend("tokamax", "xla_chunked"),
    # tokamax's plain-XLA kernel: it runs on CPU, so tests cover the exact mask and sharding
    # the GPU/TPU kernels receive.
    "tokamax_xla": AttentionBackend("tokamax", "xla"),
}
# The names that mean a kernel per platform, that of the devices a run is built for: auto is
# AUTO's (xla on every other platform), mosaic is tokamax's mosaic_<platform>.
AUTO = {"gpu": "mosaic_gpu", "tpu": "splash"}
ATTENTION_CHOICES = ("auto", "mosaic", *ATTENTION_KERNELS)
