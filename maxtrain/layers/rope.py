"""Rotary position embeddings, with optional linear, Llama-3 or YaRN frequency scaling.

Positions come from the batch (they restart at 0 in every packed document), not from
`arange(T)`. Two pairings of the rotated dims exist in published checkpoints: "rotate half"
pairs dim i with dim i + H/2 (Llama, Qwen), "interleaved" pairs 2i with 2i + 1 (DeepSeek).
`Rope(interleaved=...)` follows the checkpoint, so imported weights need no permutation.
Partial RoPE (GLM-4.5) rotates only the first `head_dim` dims of a wider head, paired among
themselves as above; the dims after them pass through without position.

YaRN (Peng et al. 2023) keeps the high frequencies (more than beta_fast rotations over the
original context), divides the low ones (fewer than beta_slow) by `factor`, and ramps linearly
between them; it also scales the logits, through the rotated dims (`magnitude`) and, in
DeepSeek's convention, the softmax scale of multi-head latent attention (`softmax_factor`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.config import RopeScaling


def _llama3(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """Llama-3: the low-frequency band slowed by `factor`, the middle band blended (none when
    the two band factors are equal: Llama 4 Scout's step)."""
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    if scaling.high_freq_factor == scaling.low_freq_factor:
        return scaled
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, blended, scaled)


def _yarn(inv_freq: np.ndarray, scaling: RopeScaling, head_dim: int, theta: float) -> np.ndarray:
    """YaRN: frequency pair j is kept, divided by `factor`, or a blend, by how many rotations
    it makes over the original context (the ramp's ends rounded outward, as published, unless
    scaling.truncate is false: GPT-OSS ramps between the exact ends)."""

    def pair_index(rotations: float) -> float:  # the pair making `rotations` turns
        turns = scaling.original_max_position / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = pair_index(scaling.beta_fast), pair_index(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = (np.arange(head_dim // 2) - low) / max(high - low, 1e-3)
    kept = 1 - np.clip(ramp, 0, 1)  # 1: the original frequency, 0: divided by factor
    return inv_freq / scaling.factor * (1 - kept) + inv_freq * kept


def yarn_temperature(factor: float, m: float) -> float:
    """YaRN's logit scale 0.1 * m * ln(factor) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


@dataclass(frozen=True)
class Rope:
    """The rotary embedding of `head_dim` dims (a head's first ones: all of it, unless partial):
    static, so frequencies are built at trace."""

    head_dim: int
    theta: float
    scaling: RopeScaling | None = None
    interleaved: bool = False

    def inverse_frequencies(self) -> np.ndarray:
        """[H/2] float32 angular frequencies."""
        H = self.head_dim
        inv_freq = 1.0 / self.theta ** (np.arange(0, H, 2, dtype=np.float64) / H)
        if self.scaling is None:
            return inv_freq.astype(np.float32)
        if self.scaling.type == "llama3":
            return _llama3(inv_freq, self.scaling).astype(np.float32)
        if self.scaling.type == "linear":  # positions divided by factor
            return (inv_freq / self.scaling.factor).astype(np.float32)
        return _yarn(inv_freq, self.scaling, H, self.theta).astype(np.float32)

    @property
    def magnitude(self) -> float:
        """What the rotated dims are multiplied by (YaRN's attention factor; else 1)."""
        s = self.scaling
        if s is None or s.type != "yarn":
            return 1.0
        if s.mscale and s.mscale_all_dim:
            return yarn_temperature(s.factor, s.mscale) / yarn_temperature(
                s.factor, s.mscale_all_dim
            )
        return yarn_temperature(s.factor, 1.0)

    @property
    def softmax_factor(self) -> float:
        """DeepSeek's extra softmax scale under YaRN, mscale_all_dim's temperature squared
        (multi-head latent attention applies it; 1 without YaRN)."""
        s = self.scaling
        if s is None or s.type != "yarn" or not s.mscale_all_dim:
            return 1.0
        return yarn_temperature(s.factor, s.mscale_all_dim) ** 2

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x: [B, T, heads, >= H], positions: [B, T] -> x with its first H dims rotated, same
        dtype. Interleaved input comes out in rotate-half order: queries and keys both do, so
        their products agree."""
        if x.shape[-1] > self.head_dim:  # partial: the rest pass through
            rotated = self(x[..., : self.head_dim], positions)
            return jnp.concatenate([rotated, x[..., self.head_dim :]], axis=-1)
        angles = positions[..., None].astype(jnp.float32) * jnp.asarray(self.inverse_frequencies())
        sin = jnp.sin(angles)[:, :, None, :] * self.magnitude  # [B, T, 1, H/2]
        cos = jnp.cos(angles)[:, :, None, :] * self.magnitude
        x32 = x.astype(jnp.float32)
        if self.interleaved:
            x1, x2 = x32[..., 0::2], x32[..., 1::2]
        else:
            x1, x2 = jnp.split(x32, 2, axis=-1)
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return rotated.astype(x.dtype)
