"""The `model:` section: the architecture, and nothing else. Every key changes the parameters'
shapes or the function the model computes; a model file (configs/models/<name>.yml) holds
exactly these keys. How a run computes the model is `compute:` (compute.py), how it
initialises it `init:`. Each fact is said once: multi-head latent attention by the presence of
`mla:`, every layer's kind by `layers:` (layer_list.py), RoPE by `rope:` (rope.py), the experts
by `moe:` (moe.py); a key no layer reads is refused, not ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from maxtrain.config.domains import NonNegativeFloat, PositiveFloat, PositiveInt, Section
from maxtrain.config.layer_list import LayerType, checked_entry, layer_types, shortest_entries
from maxtrain.config.moe import MoeConfig
from maxtrain.config.rope import RopeConfig

# A layer's token mixer, which picks its parameter stack (models/stacks.py).
type Mixer = Literal["attention", "linear"]
LayerEntry = Annotated[str, AfterValidator(checked_entry)]


class MtpConfig(Section):
    """Multi-token prediction (DeepSeek-V3, models/mtp.py): `depth` extra modules, module j
    predicting the token j + 1 places after the next; their mean loss, times `loss_weight`, is
    added to the training loss."""

    depth: int = Field(default=0, ge=0)  # 0 = off
    loss_weight: NonNegativeFloat = 0.3


class IndexerConfig(Section):
    """The lightning indexer of DeepSeek sparse attention (layers/indexer.py): `heads` cheap
    query heads of `head_dim` against one key per token, scored sum_h w_h relu(q_h . k), pick
    each query's `top_k` keys, over which multi-head latent attention runs. Its queries come
    from the query latent (mla.q_lora_rank); its first qk_rope_head_dim dims are rotated."""

    heads: PositiveInt = 64
    head_dim: PositiveInt = 128
    top_k: PositiveInt = 2048
    # RoPE pairing of the indexer's rotary dims: DeepSeek-V3.2 rotates halves (false), GLM-5
    # interleaved pairs (true), whatever the attention's own pairing (model.rope.interleaved).
    rope_interleaved: bool = False
    # The training stage (docs/deepseek.md). warmup: attention stays dense and only the
    # indexer trains (the rest frozen, read from checkpoint.load_parameters_path), towards the
    # attention's distribution over the visible keys; sparse: attention over the chosen keys,
    # the indexer towards the distribution over them. Either way its input is detached: its
    # KL loss alone trains it, and it never trains the rest of the model.
    stage: Literal["warmup", "sparse"] = "sparse"
    loss_weight: NonNegativeFloat = 1.0  # times the KL (mean over tokens and layers)


class MlaConfig(Section):
    """Multi-head latent attention (DeepSeek-V2/V3; layers/mla.py): queries and keys/values
    through low-rank latents; each head's query/key is a per-head part without position plus a
    rotary part whose key is shared by all heads. Set, it is every attention layer's."""

    q_lora_rank: PositiveInt | None = None  # null: a plain query projection (DeepSeek-V2-Lite)
    kv_lora_rank: int = Field(gt=0)  # the key/value latent (what inference caches)
    qk_nope_head_dim: int = Field(gt=0)  # per head, without position
    qk_rope_head_dim: int = Field(gt=0, multiple_of=2)  # rotary part (key shared by all heads)
    v_head_dim: int = Field(gt=0)  # value head size; may differ from the query/key head size
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): each query attends to the top_k keys
    # a lightning indexer picks (layers/indexer.py); null: every causal key.
    indexer: IndexerConfig | None = None
    # false: the rotary part is not rotated either, no layer sees a position (Kimi Linear's
    # NoPE MLA; its key part is still one for all heads)
    rope: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @model_validator(mode="after")
    def _check_indexer(self) -> MlaConfig:
        """The indexer reads the query latent and rotates the attention's rotary dims."""
        if self.indexer is None:
            return self
        if self.q_lora_rank is None:
            raise ValueError(
                "model.mla.indexer needs model.mla.q_lora_rank (its queries come from the "
                "query latent); set it"
            )
        if self.indexer.head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"model.mla.indexer.head_dim ({self.indexer.head_dim}) must be at least "
                f"model.mla.qk_rope_head_dim ({self.qk_rope_head_dim}), the dims it rotates"
            )
        return self


class LinearAttention(Section):
    """The `linear` layers of model.layers: Gated DeltaNet (Qwen3-Next, Qwen3.5; with
    channel_decay Kimi Delta Attention, Kimi Linear's), a recurrence over a
    fixed-size state per head in place of softmax attention (layers/gated_deltanet.py), whose
    cost grows linearly with the sequence. Query/key heads may be fewer than value heads (a
    divisor of them), as attention's key/value heads are."""

    num_key_heads: PositiveInt  # query and key heads
    num_value_heads: PositiveInt  # value heads (the state has one [key_head_dim, value_head_dim])
    key_head_dim: PositiveInt = 128
    value_head_dim: PositiveInt = 128
    conv_kernel: PositiveInt = 4  # taps of the causal depthwise convolution over q, k and v
    chunk: PositiveInt = 64  # training computes the recurrence in chunks of this many tokens
    # Kimi Delta Attention (Kimi Linear): the decay per key channel, not per head, from a
    # projection of rank key_head_dim; the output gate from one of rank value_head_dim, and
    # sigmoid, not silu, of it scaling the normed output.
    channel_decay: bool = False

    @model_validator(mode="after")
    def _check_heads(self) -> LinearAttention:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"model.linear_attention.num_value_heads ({self.num_value_heads}) must be a "
                f"multiple of model.linear_attention.num_key_heads ({self.num_key_heads})"
            )
        return self


class AttentionTemperature(Section):
    """Llama 4's attention temperature tuning, on the `nope` layers of model.layers: a query at
    position p is multiplied by 1 + scale * ln(1 + floor((p + 1) / floor))."""

    floor: PositiveInt
    scale: NonNegativeFloat = 0.1


class ModelConfig(Section):
    """The model itself: what its parameters' shapes and its function depend on. A model file
    (configs/models/<name>.yml) holds these keys; tools/convert_hf.py writes them."""

    vocab_size: int = Field(gt=0)
    emb_dim: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: PositiveInt | None = None  # null: num_heads (grouped-query attention)
    head_dim: PositiveInt | None = None  # null: emb_dim // num_heads (grouped-query attention)
    mlp_dim: PositiveInt | None = None  # the dense layers' width: set iff a layer is dense
    rope: RopeConfig = RopeConfig()
    mla: MlaConfig | None = None  # set: multi-head latent attention (layers/mla.py)
    # RMS norm of each query and key head before RoPE: rms with a learned scale (Qwen3, Gemma
    # 3), rms_unscaled without one (Llama 4); `nope` layers skip it.
    qk_norm: Literal["none", "rms", "rms_unscaled"] = "none"
    # The attention logits are divided by sqrt(this) instead of sqrt(head_dim) (Gemma 3's
    # query_pre_attn_scalar); null: sqrt(head_dim).
    softmax_scale_dim: PositiveInt | None = None
    # Which attention projections carry a bias: GLM-4.5 and Qwen2 have q, k and v biases;
    # GPT-OSS has the output's too.
    attention_projection_bias: Literal["none", "qkv", "qkvo"] = "none"
    # GPT-OSS: a learned logit per query head that joins the softmax's denominator and carries
    # no value (kernels/xla_attention.py masked_attention), so a head may attend to nothing.
    attention_sinks: bool = False
    # Qwen3-Next: the attention output, per head and dim, times sigmoid of a gate projected
    # from the layer's input (x W_gate [D, N, H]), before the output projection.
    attention_output_gate: bool = False
    # Every layer's attention and feed-forward kind (layer_list.py), e.g. [global-dense*3,
    # global-moe*58]; null: every layer global, MoE iff `moe` is set.
    layers: list[LayerEntry] | None = Field(default=None, min_length=1)
    # A sliding layer's query sees itself and the sliding_window - 1 keys before it; a chunked
    # layer's the earlier keys of its chunk (position // attention_chunk). Set iff such a
    # layer exists.
    sliding_window: PositiveInt | None = None
    attention_chunk: PositiveInt | None = None
    linear_attention: LinearAttention | None = None  # set iff a layer is linear
    attention_temperature: AttentionTemperature | None = None  # nope layers only (Llama 4)
    tie_embeddings: bool = False
    # The token embeddings multiplied by sqrt(emb_dim), in the compute dtype (Gemma).
    scale_embeddings: bool = False
    norm_eps: PositiveFloat = 1e-5
    # Every RMSNorm scales by 1 + w instead of w, w starting at 0 (Gemma's RMSNorm).
    norm_scale_plus_one: bool = False
    # pre: a norm before attention and before the feed-forward (Llama). sandwich: their outputs
    # normed too, before they join the residual stream (Gemma 2 and 3).
    block_norms: Literal["pre", "sandwich"] = "pre"
    # The dense feed-forward's gate activation: silu (SwiGLU) or tanh-approximated gelu (GeGLU,
    # Gemma's gelu_pytorch_tanh).
    mlp_activation: Literal["silu", "gelu_tanh"] = "silu"
    max_seq_len: PositiveInt = 8192
    moe: MoeConfig | None = None
    mtp: MtpConfig = MtpConfig()

    @model_validator(mode="before")
    @classmethod
    def _shortest_layers(cls, data: Any) -> Any:
        """model.layers as the shortest list that gives the model's layers, what a dump (the
        run's config.yml, the run identity) shows: [global-dense*3, global-moe*58] on 5 layers
        is [global-dense*3, global-moe*2]; null where it is the default. A list that does not
        parse is left to the field's check, which names the bad entry."""
        if not isinstance(data, dict):
            return data
        entries, num_layers = data.get("layers"), data.get("num_layers")
        if not (isinstance(entries, list) and entries and isinstance(num_layers, int)):
            return data
        moe = data.get("moe") is not None
        try:
            types = layer_types(entries, max(num_layers, 1), moe)
        except ValueError:
            return data
        return {**data, "layers": shortest_entries(types, moe)}

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.num_heads % self.resolved_kv_heads:
            raise ValueError(
                f"model.num_heads ({self.num_heads}) must be a multiple of "
                f"model.num_kv_heads ({self.num_kv_heads})"
            )
        if self.mla is None and self.head_dim is None and self.emb_dim % self.num_heads:
            raise ValueError(
                f"model.emb_dim ({self.emb_dim}) is not divisible by model.num_heads "
                f"({self.num_heads}); set model.head_dim explicitly"
            )
        if self.moe is not None and self.mlp_activation != "silu":
            raise ValueError(
                f"model.mlp_activation {self.mlp_activation} is not supported with model.moe "
                "(the experts are SwiGLU)"
            )
        if self.mla is None and self.rope.fraction != 1:
            rotated = self.resolved_head_dim * self.rope.fraction
            if rotated != int(rotated) or int(rotated) % 2:
                raise ValueError(
                    f"model.rope.fraction ({self.rope.fraction}) x head_dim "
                    f"({self.resolved_head_dim}) = {rotated:g} dims to rotate, not an even number"
                )
        return self

    @model_validator(mode="after")
    def _check_mla(self) -> ModelConfig:
        """Multi-head latent attention has its own heads, norms and rotary dims: the keys of
        grouped-query attention are refused beside it, not ignored."""
        if self.mla is None:
            return self
        gqa_only = {
            "num_kv_heads": self.num_kv_heads is not None,
            "head_dim": self.head_dim is not None,
            "qk_norm": self.qk_norm != "none",
            "softmax_scale_dim": self.softmax_scale_dim is not None,
            "attention_projection_bias": self.attention_projection_bias != "none",
            "attention_sinks": self.attention_sinks,
            "attention_output_gate": self.attention_output_gate,
            "rope.fraction": self.rope.fraction != 1,
        }
        for key, is_set in gqa_only.items():
            if is_set:
                raise ValueError(
                    f"model.{key} applies to grouped-query attention, not to multi-head latent "
                    f"attention (model.mla is set); remove it"
                )
        if not self.mla.rope and self.rope.scaling is not None:
            raise ValueError(
                "model.rope.scaling scales a rotation, and model.mla.rope is false (NoPE); "
                "remove one"
            )
        kinds = sorted({t.attention for t in self.layer_types} - {"global", "linear"})
        if kinds:
            raise ValueError(
                f"model.layers' {kinds[0]} layers need grouped-query attention, not model.mla"
            )
        return self

    @model_validator(mode="after")
    def _check_layers(self) -> ModelConfig:
        """Each layer kind's section is set iff a layer of that kind exists."""
        attention = {t.attention for t in self.layer_types}
        ffn = {t.ffn for t in self.layer_types}
        needed = {
            "sliding_window": ("sliding" in attention, "sliding layers"),
            "attention_chunk": ("chunked" in attention, "chunked layers"),
            "linear_attention": ("linear" in attention, "linear layers"),
            "moe": ("moe" in ffn, "moe layers"),
            "mlp_dim": ("dense" in ffn, "dense layers"),
        }
        for key, (needs, what) in needed.items():
            if needs and getattr(self, key) is None:
                raise ValueError(f"model.layers has {what}, which need model.{key}")
            if not needs and getattr(self, key) is not None:
                raise ValueError(f"model.{key} is set but model.layers has no {what}; remove it")
        optional = {
            "attention_temperature": (self.attention_temperature, {"nope"}, "nope layers"),
            "rope.local_theta": (
                self.rope.local_theta,
                {"sliding", "chunked"},
                "sliding or chunked layers",
            ),
        }
        for key, (value, readers, what) in optional.items():
            if value is not None and not attention & readers:
                raise ValueError(f"model.{key} is set but model.layers has no {what}; remove it")
        return self

    @property
    def layer_types(self) -> tuple[LayerType, ...]:
        """Per model layer (0-based), its attention and feed-forward kind (layer_list.py)."""
        return layer_types(self.layers, self.num_layers, self.moe is not None)

    def layer_attention(self, layer: int) -> str:
        """Model layer `layer`'s attention kind: global, sliding, chunked, nope or linear."""
        return self.layer_types[layer].attention

    def layer_mixer(self, layer: int) -> Mixer:
        """Model layer `layer`'s token mixer, which picks its parameter stack
        (models/stacks.py): softmax "attention", or "linear" attention (a recurrence)."""
        return "linear" if self.layer_attention(layer) == "linear" else "attention"

    def is_moe_layer(self, layer: int) -> bool:
        """Whether model layer `layer`'s feed-forward block is a mixture of experts."""
        return self.layer_types[layer].ffn == "moe"

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.emb_dim // self.num_heads

    @property
    def resolved_kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads
