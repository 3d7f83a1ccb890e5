"""How a gated feed-forward combines its gate and up projections, picked once per model.

SwiGLU, silu(gate) * up, is every family's but one. GPT-OSS's experts clamp both projections
first and shift the up projection by one: min(gate, limit) * sigmoid(alpha * min(gate, limit))
* (clip(up, -limit, limit) + 1). The clamp bounds what an expert can emit, whatever a token's
activations (the up projection's gradient is zero where it clips, the gate's above `limit`).

Activations are frozen dataclasses or plain functions: hashable, so the MoE layer can carry one
as static data through the experts' exchanges (layers/routed_experts.py ExpertWeights).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from maxtrain.config import ClampedSwiglu as ClampedSwigluConfig

type GatedActivation = Callable[[jax.Array, jax.Array], jax.Array]  # (gate, up) -> hidden


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


@dataclass(frozen=True)
class ClampedSwiglu:
    alpha: float
    limit: float

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * gate * jax.nn.sigmoid(self.alpha * gate)


def gated_activation(clamped: ClampedSwigluConfig | None) -> GatedActivation:
    """The activation a `moe.clamped_swiglu` setting picks (None: SwiGLU)."""
    return swiglu if clamped is None else ClampedSwiglu(clamped.alpha, clamped.limit)
