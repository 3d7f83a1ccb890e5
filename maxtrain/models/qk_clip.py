"""QK-clip, the weight rescale of MuonClip (Kimi K2, arXiv 2507.20534 sec. 2.1): attention
logits kept from growing without bound by shrinking the query and key weights of the heads
whose largest logit went past a threshold tau, right after each optimizer update.

A head h whose largest pre-softmax logit over the step's batch was S_h > tau gets the factor
gamma_h = tau / S_h (1 otherwise); its logits q . k are linear in its query and its key
weights, so scaling each by sqrt(gamma_h) scales every logit of the head by gamma_h: the
largest would have been tau. Where the rule needs care:

- Grouped-query attention: one key head serves the G query heads of its group, which may want
  different factors. The key head takes sqrt of the group's smallest factor, sqrt(gamma_min),
  and each query head gamma_h / sqrt(gamma_min). Every head's logits then scale by exactly its
  own gamma_h, as under multi-head attention: a head that stayed below tau keeps its scores
  (its query weights grow by what its key lost), and no head is clipped more than it needs.
  Scaling each query head by sqrt(gamma_h) instead would keep the weights from growing but
  shrink the logits of the group's innocent heads by up to sqrt(gamma_min).
  Query and key biases scale with their weights (the projection is affine: q = x W + b).
- Multi-head latent attention (Kimi K2's own rule): a head's key is [k_nope | k_rope] with
  k_rope shared by all heads. The head-specific q_nope and k_nope (the up-projection kv_b's
  key columns) scale by sqrt(gamma_h); q_rope, which meets only the shared k_rope, by
  gamma_h; k_rope (kv_a) is untouched. The values' columns of kv_b are untouched.

The max logits come from the forward pass (kernels/xla_attention.py, stats key MAX_LOGIT,
combined over micro-batches by max); the rescale runs on the parameters the optimizer just
produced, whatever the optimizer (ModelDef.after_update), and never touches optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from maxtrain.config import ModelConfig
from maxtrain.models.stacks import layer_kinds, rows_per_stack

# The statistics key of the attention layers' max logits: [attention layers in model order, N]
# float32, each query head's largest logit over the batch (padding queries left out).
MAX_LOGIT = "attention_max_logit"
MIXER = "attn"  # the attention block's attribute: its parameters' key (models/decoder.py)


def clip_factors(max_logits: jax.Array, threshold: float) -> jax.Array:
    """gamma = tau / S where S > tau, else 1 (a head with no real query has S = finfo.min)."""
    s = max_logits.astype(jnp.float32)
    return jnp.where(s > threshold, threshold / jnp.where(s > threshold, s, 1.0), 1.0)


def gqa_scales(gamma: jax.Array, num_kv_heads: int) -> tuple[jax.Array, jax.Array]:
    """Per-head factors gamma [..., N] -> (query head scales [..., N], key head scales
    [..., K]): query head n reads key head n // G (G = N / K)."""
    *lead, n = gamma.shape
    grouped = gamma.reshape(*lead, num_kv_heads, n // num_kv_heads)
    key = jnp.sqrt(jnp.min(grouped, axis=-1))
    return (grouped / key[..., None]).reshape(*lead, n), key


def mla_scales(gamma: jax.Array, nope: int, rope: int) -> tuple[jax.Array, jax.Array]:
    """Per-head factors gamma [..., N] -> the scale of each query dim [..., N, nope + rope]
    (sqrt(gamma) on q_nope, gamma on q_rope) and of each key dim of kv_b's per-head output
    [..., N, nope] (sqrt(gamma) on k_nope; its value dims are left as they are)."""
    nope_part = jnp.broadcast_to(jnp.sqrt(gamma)[..., None], (*gamma.shape, nope))
    rope_part = jnp.broadcast_to(gamma[..., None], (*gamma.shape, rope))
    return jnp.concatenate([nope_part, rope_part], axis=-1), nope_part


def _scaled(projection: dict, scale: jax.Array) -> dict:
    """A projection {kernel [L, in, N, H], bias? [L, N, H]} with its outputs scaled: scale
    [L, N] scales each head whole, [L, N, W] the first W of each head's H output dims (the rest
    stay as they are). Computed in float32, stored in the parameter's dtype."""
    per_dim = scale if scale.ndim == 3 else scale[..., None]

    def times(x: jax.Array) -> jax.Array:  # x [L, ..., N, H]
        width = per_dim.shape[-1] if scale.ndim == 3 else x.shape[-1]
        s = per_dim.reshape(per_dim.shape[0], *(1,) * (x.ndim - 3), *per_dim.shape[1:])
        head = (x[..., :width].astype(jnp.float32) * s).astype(x.dtype)
        return jnp.concatenate([head, x[..., width:]], axis=-1)

    return {name: times(value) for name, value in projection.items()}


@dataclass(frozen=True)
class QKClip:
    """The rescale of one model: its attention stacks and their rows among the max logits."""

    threshold: float
    stacks: tuple[tuple[str, tuple[int, ...]], ...]  # stack key, its rows in stack order
    num_kv_heads: int
    mla: tuple[int, int] | None  # MLA's (qk_nope_head_dim, qk_rope_head_dim); None: GQA

    @classmethod
    def of(cls, cfg: ModelConfig, threshold: float) -> QKClip:
        attention = [kind for kind in layer_kinds(cfg) if kind.mixer == "attention"]
        mla = (cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim) if cfg.mla else None
        return cls(threshold, rows_per_stack(attention), cfg.resolved_kv_heads, mla)

    def __call__(self, params: Any, stats: dict[str, jax.Array]) -> Any:
        """`params` with every attention stack's query and key weights rescaled."""
        gamma = clip_factors(stats[MAX_LOGIT], self.threshold)  # [attention layers, N]
        for stack, rows in self.stacks:
            # (pipelined stacks, under params["stages"], are refused: config/schema.py)
            attn = dict(params[stack][MIXER])
            attn.update(self._rescaled(attn, gamma[jnp.asarray(rows)]))
            params = {**params, stack: {**params[stack], MIXER: attn}}
        return params

    def _rescaled(self, attn: dict, gamma: jax.Array) -> dict:
        if self.mla is None:
            q, k = gqa_scales(gamma, self.num_kv_heads)
            return {"q": _scaled(attn["q"], q), "k": _scaled(attn["k"], k)}
        q, k = mla_scales(gamma, *self.mla)
        query = "q_b" if attn.get("q_b") else "q"  # with model.mla.q_lora_rank: q_b
        return {query: _scaled(attn[query], q), "kv_b": _scaled(attn["kv_b"], k)}
