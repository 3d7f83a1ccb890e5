"""Qwen3-Next (Qwen3NextForCausalLM): Gated DeltaNet layers (layer_types' linear_attention,
else all but every full_attention_interval-th) beside gated attention (q_proj holds per head
its query, then an output gate: model.attention_output_gate), partial RoPE (0.25 when absent:
Qwen3NextConfig sets it), qk-norm, every RMSNorm 1 + w; Qwen3-MoE's router and choice of MoE
layers, with a shared expert (shared_expert_intermediate_size wide) whose output a sigmoid
gate scales (shared_expert_gate.weight [1, D]).

transformers projects a DeltaNet layer's q, k, v and z with one linear map and b and a with
another, their outputs grouped by query/key head: with G = Nv / Nk value heads per query/key
head, output row block g (g < Nk) of

    in_proj_qkvz.weight [Nk (2 dk + 2 G dv), D]  is  [q_g (dk) | k_g (dk) | v_g (G dv) | z_g (G dv)]
    in_proj_ba.weight   [Nk (2 G), D]            is  [b_g (G) | a_g (G)]

where v_g, z_g, b_g and a_g hold value heads g G .. g G + G - 1 in order. The convolution is one
depthwise conv1d over the concatenation of q, k and v, each head-major:

    conv1d.weight [2 Nk dk + Nv dv, 1, K]  is  [q (Nk dk) | k (Nk dk) | v (Nv dv)]

its K taps oldest first. Our layer keeps each of them apart, heads as their own axis
(layers/gated_deltanet.py): projections [D, heads, head dim] (b, a: [D, Nv]), taps [K, heads,
head dim]. out_proj.weight [D, Nv dv] is our o kernel [Nv, dv, D] flattened and transposed;
norm.weight [dv], A_log [Nv] and dt_bias [Nv] are ours as they are.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from maxtrain.config import LayerType, LinearAttention, ModelConfig
from maxtrain.hf.aspect import Aspect, HfConfig
from maxtrain.hf.attention import GroupedQuery
from maxtrain.hf.family import TRANSFORMERS_DEFAULTS, Family, RopeFormat
from maxtrain.hf.feed_forward import DenseMlp, Experts
from maxtrain.hf.layer_layout import EveryNth, LayerLayout, LayerTypes, SparseStep
from maxtrain.hf.layout import LayerSite, Part, Slot

# config.json's keys of the Gated DeltaNet -> model.linear_attention's.
_LINEAR_KEYS = {
    "linear_num_key_heads": "num_key_heads",
    "linear_num_value_heads": "num_value_heads",
    "linear_key_head_dim": "key_head_dim",
    "linear_value_head_dim": "value_head_dim",
    "linear_conv_kernel_dim": "conv_kernel",
}
SHARED_WIDTH, EXPERT_WIDTH = "shared_expert_intermediate_size", "moe_intermediate_size"
LINEAR_ATTN = "linear_attn"  # a Gated DeltaNet layer's tensors' prefix
# Which layers are linear: layer_types, else all but every full_attention_interval-th.
LAYER_TYPES = LayerTypes(
    names={"linear_attention": "linear", "full_attention": "global"},
    every=EveryNth("full_attention_interval", "global", "linear"),
)
# What every Qwen3-Next and Qwen3.5 checkpoint has (a section's keys only where it is set).
HYBRID_FIXED = {
    "qk_norm": "rms",
    "norm_scale_plus_one": True,
    "attention_output_gate": True,
    "moe.shared_expert_gate": True,
}


def linear_attention_tensors(linear: LinearAttention) -> tuple:
    """A Gated DeltaNet layer's tensors inside `linear_attn.`, its projections fused and
    grouped by query/key head as Qwen3-Next stores them: (our path, Hugging Face name, input
    axes, Part, unit axis: conv1d's input channel per group)."""
    nk, nv, la = linear.num_key_heads, linear.num_value_heads, LINEAR_ATTN
    dk, dv, group = linear.key_head_dim, linear.value_head_dim, nv // nk
    qkvz, ba = (dk, dk, group * dv, group * dv), (group, group)
    return (
        *(
            ((la, ours, "kernel"), f"{la}.in_proj_qkvz.weight", 1, Part(i, qkvz), None)
            for i, ours in enumerate("qkvz")
        ),
        *(
            ((la, ours, "kernel"), f"{la}.in_proj_ba.weight", 1, Part(i, ba), None)
            for i, ours in enumerate("ba")
        ),
        *linear_state_tensors(linear),
    )


def linear_state_tensors(linear: LinearAttention) -> tuple:
    """The tensors of a Gated DeltaNet layer besides its input projections, alike in every
    family that has one (linear_attention_tensors' tuples): the convolution over q, k and v
    head-major, the output projection, the decay's A_log and dt_bias, the output norm."""
    nk, nv, la = linear.num_key_heads, linear.num_value_heads, LINEAR_ATTN
    conv = (nk * linear.key_head_dim, nk * linear.key_head_dim, nv * linear.value_head_dim)
    return (
        *(
            ((la, f"{ours}_conv"), f"{la}.conv1d.weight", 1, Part(i, conv), 1)
            for i, ours in enumerate("qkv")
        ),
        ((la, "o", "kernel"), f"{la}.out_proj.weight", 2, None, None),
        ((la, "a_log"), f"{la}.A_log", None, None, None),
        ((la, "dt_bias"), f"{la}.dt_bias", None, None, None),
        ((la, "norm", "scale"), f"{la}.norm.weight", None, None, None),
    )


def is_hybrid(cfg: ModelConfig) -> bool:
    """Whether `cfg` is of the Qwen3-Next shape (Gated DeltaNet layers or gated attention),
    which the Qwen3-Next and Qwen3.5 families share."""
    return cfg.linear_attention is not None or cfg.attention_output_gate


@dataclass(frozen=True)
class GatedDeltaNet(Aspect):
    """model.linear_attention (its `chunk` is ours to choose, not the checkpoint's) and the
    linear layers' tensors, as `layout` names them (Qwen3-Next's fused projections by
    default); written at transformers' defaults where no layer is linear."""

    layout: Callable[[LinearAttention], tuple] = linear_attention_tensors
    owns = frozenset({"linear_attention"})

    def read(self, hf: HfConfig, layers: Sequence[LayerType]) -> dict[str, Any]:
        if all(t.attention != "linear" for t in layers):
            return {}
        return {"linear_attention": {ours: hf[key] for key, ours in _LINEAR_KEYS.items()}}

    def write(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        linear = cfg.linear_attention
        return {
            key: getattr(linear, ours) if linear else defaults[key]
            for key, ours in _LINEAR_KEYS.items()
        }

    def unexpressed(self, cfg: ModelConfig) -> list[str]:
        linear = cfg.linear_attention
        if linear is not None and linear.channel_decay:
            return ["model.linear_attention.channel_decay=true (Kimi Delta Attention)"]
        return []

    def tensors(self, cfg: ModelConfig, site: LayerSite) -> list[Slot]:
        if site.mixer != "linear":
            return []
        assert cfg.linear_attention is not None  # a linear layer implies it
        return [
            replace(site.slot(name, path, in_axes, part), unit_axis=unit_axis)
            for path, name, in_axes, part, unit_axis in self.layout(cfg.linear_attention)
        ]


class SharedExpertWidth(Aspect):
    """The shared expert as wide as shared_expert_intermediate_size: model.moe.shared_experts
    routed experts' widths."""

    owns = frozenset({"moe.shared_experts"})

    def read(self, hf: HfConfig, layers: Sequence[LayerType]) -> dict[str, Any]:
        width, expert = hf[SHARED_WIDTH], hf[EXPERT_WIDTH]
        if not isinstance(width, int) or width <= 0 or width % expert:
            raise hf.error(
                f"{SHARED_WIDTH}={width} is not supported (only a positive multiple of "
                f"{EXPERT_WIDTH}={expert})"
            )
        return {"moe": {"shared_experts": width // expert}}

    def write(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        assert cfg.moe is not None
        return {SHARED_WIDTH: cfg.moe.shared_experts * cfg.moe.expert_mlp_dim}

    def unexpressed(self, cfg: ModelConfig) -> list[str]:
        if cfg.moe is not None and not cfg.moe.shared_experts:
            return ["model.moe.shared_experts=0 (its MoE layers have a shared expert)"]
        return []


# transformers' values for absent keys that Qwen3-Next and Qwen3.5 (qwen3_5_text.py) share:
# the hybrid's layout and the Gated DeltaNet's sizes.
HYBRID_DEFAULTS = {
    **TRANSFORMERS_DEFAULTS,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "head_dim": 256,
    "layer_types": None,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}

FAMILY = Family(
    model_type="qwen3_next",
    architecture="Qwen3NextForCausalLM",
    defaults={
        **HYBRID_DEFAULTS,
        "num_key_value_heads": 2,
        "intermediate_size": 5632,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        EXPERT_WIDTH: 512,
        SHARED_WIDTH: 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 1e-3,
    },
    required={"hidden_act": "silu", "attention_bias": False},
    layers=LayerLayout(LAYER_TYPES, SparseStep()),
    aspects=(
        GroupedQuery(),
        GatedDeltaNet(),  # before the feed-forward: a layer's tensors in transformers' order
        DenseMlp(),
        Experts(
            count_keys=("num_experts",),
            width_key=EXPERT_WIDTH,
            renormalize_key="norm_topk_prob",
            shared_block="shared_expert",
        ),
        SharedExpertWidth(),
    ),
    fixed=HYBRID_FIXED,
    rope=RopeFormat(partial_default=0.25),
    # Qwen3.5 (qwen3_5_text.py, qwen3_5_moe_text.py) computes the same and ranks above: export
    # writes Qwen3-Next only what Qwen3.5 cannot state (dense layers beside MoE ones, top-k
    # weights not renormalised).
    claims=is_hybrid,
    rank=10,
)
