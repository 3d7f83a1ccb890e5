"""The next token from a row's logits: greedy, or sampled with temperature, top-k and top-p."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from maxtrain.common.errors import UserError


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (argmax); otherwise the logits are divided by the temperature,
    cut to the top_k most likely tokens (0: all) and to the smallest set whose probability
    reaches top_p (1: all), and a token is drawn."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature < float("inf"):
            raise UserError(f"temperature must be a finite number >= 0 (got {self.temperature})")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (got {self.top_k})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def next_tokens(logits: jax.Array, rng: jax.Array, sampling: Sampling) -> jax.Array:
    """logits [B, V] -> token ids [B] int32."""
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    masked = jnp.finfo(jnp.float32).min
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, masked, logits)
    if sampling.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # keep a token if the tokens more likely than it hold less than top_p: the first always
        before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.where(before < sampling.top_p, sorted_logits, jnp.inf).min(-1, keepdims=True)
        logits = jnp.where(logits < cutoff, masked, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)
