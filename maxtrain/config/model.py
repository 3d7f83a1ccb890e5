"""The `model:` section: the architecture (what parameters' shapes and the function depend on)
and the run-time keys of how a run initialises, stores and computes it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from maxtrain.config.domains import NonNegativeFloat, PositiveFloat, PositiveInt, Section

# A layer's token mixer (ModelArchitecture.layer_mixer).
type Mixer = Literal["attention", "linear"]


class RopeScaling(Section):
    """RoPE frequency scaling for a longer context (absent = no scaling); `type` picks the
    method, and with it which of the other keys apply (layers/rope.py)."""

    # linear: every frequency divided by factor (Gemma 3's global layers)
    type: Literal["llama3", "yarn", "linear"] = "llama3"
    factor: PositiveFloat = 8.0  # all: how much longer than original_max_position
    original_max_position: PositiveInt = 8192  # llama3, yarn: the context the model was trained at
    low_freq_factor: PositiveFloat = 1.0  # llama3
    # llama3; equal to low_freq_factor: no blended band (Llama 4 Scout's 1 and 1)
    high_freq_factor: PositiveFloat = 4.0
    beta_fast: PositiveFloat = 32.0  # yarn: rotations above which a frequency is kept
    beta_slow: PositiveFloat = 1.0  # yarn: rotations below which it is divided by factor
    # yarn: the logits' temperature, 0.1 * m * ln(factor) + 1 for m = mscale (on the rotated
    # dims, divided by the same for mscale_all_dim) and, squared, for m = mscale_all_dim on the
    # softmax scale of multi-head latent attention. mscale_all_dim 0: DeepSeek's term is off.
    mscale: NonNegativeFloat = 1.0
    mscale_all_dim: NonNegativeFloat = 0.0
    # yarn: round the ramp's ends outward to whole frequency pairs (the published YaRN, DeepSeek);
    # false: the exact ends (GPT-OSS).
    truncate: bool = True

    @model_validator(mode="after")
    def _check_band(self) -> RopeScaling:
        if self.type == "llama3" and self.high_freq_factor < self.low_freq_factor:
            raise ValueError(
                f"model.rope_scaling.high_freq_factor ({self.high_freq_factor}) must be at least "
                f"model.rope_scaling.low_freq_factor ({self.low_freq_factor})"
            )
        return self


class ClampedSwiglu(Section):
    """GPT-OSS's experts' activation in place of SwiGLU's silu(gate) * up: the gate clamped
    above at `limit`, the up projection to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate) (layers/activations.py)."""

    alpha: PositiveFloat = 1.702
    limit: PositiveFloat = 7.0


class KernelTiles(Section):
    """One grouped matmul kernel's tiles: fields of the platform's tokamax kernel config, null
    for tokamax's choice (its autotuning cache for the exact shape, else its heuristics).
    models/build.py platform_choices checks them against the kernel of the devices' platform."""

    # TPU (tokamax's Mosaic TPU kernel): rows, contraction and output columns per tile, and the
    # input buffers its pipeline keeps.
    tile_m: PositiveInt | None = None
    tile_k: PositiveInt | None = None
    tile_n: PositiveInt | None = None
    input_buffer_count: PositiveInt | None = None
    # GPU (tokamax's Mosaic GPU kernel; the first five are named together): the output block,
    # its contraction step, the software pipeline's stages, the contraction's split, and how
    # many blocks wide the grid walks.
    block_m: PositiveInt | None = None
    block_n: PositiveInt | None = None
    block_k: PositiveInt | None = None
    num_stages: PositiveInt | None = None
    split_k: PositiveInt | None = None
    grid_tile_width: PositiveInt | None = None

    def named(self) -> dict[str, int]:
        return {field: value for field, value in self if value is not None}


class ProjectionTiles(Section):
    """A projection's tiles per pass: its product, and the gradients of its rows and weights,
    each a kernel of its own."""

    forward: KernelTiles = KernelTiles()
    input_grad: KernelTiles = KernelTiles()
    weight_grad: KernelTiles = KernelTiles()


def named_tiles(tiles: dict[str, ProjectionTiles]) -> dict[str, dict[str, dict[str, int]]]:
    """{projection: {pass: {field: value}}} of the tiles named in model.moe.grouped_matmul_tiles,
    nothing else."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for projection, passes in tiles.items():
        for name, kernel in passes:
            if fields := kernel.named():
                out.setdefault(projection, {})[name] = fields
    return out


class MoeConfig(Section):
    """Mixture-of-experts feed-forward layers (absent = a dense model)."""

    num_experts: int = Field(gt=0)
    top_k: int = Field(gt=0)
    expert_mlp_dim: int = Field(gt=0)  # hidden size of each routed expert (SwiGLU)
    shared_experts: int = Field(default=0, ge=0)  # always-on experts, fused into one SwiGLU
    # Qwen3-Next: the shared experts' output times sigmoid(x w), w [D] learned per layer.
    shared_expert_gate: bool = False
    score: Literal["softmax", "sigmoid"] = "softmax"  # router score function
    renormalize: bool = True  # rescale the top-k weights to sum to 1
    routed_scale: PositiveFloat = 1.0  # multiplies the routed experts' output
    # What a chosen expert's weight multiplies: its output (the usual) or its input (Llama 4:
    # the expert computes SwiGLU(weight * x)).
    weight_on: Literal["output", "input"] = "output"
    # Group-limited routing (DeepSeek-V3): the experts form n_group equal groups of consecutive
    # ids; each token keeps the topk_group groups whose two best scores sum highest and picks
    # its top_k inside them. With expert parallelism a group lives on one block of devices, so
    # a token reaches at most topk_group such blocks. n_group 1 = plain top-k.
    n_group: PositiveInt = 1
    topk_group: PositiveInt = 1
    # Which layers are MoE: layer i (0-based) is MoE iff i >= first_dense_layers and
    # (i + 1) % interval == 0. interval 1 = every layer; 2 = every second layer (1, 3, ...).
    first_dense_layers: int = Field(default=0, ge=0)
    interval: int = Field(default=1, gt=0)
    # GPT-OSS: the router's linear map has a bias, added to its logits and trained like a
    # weight (not bias_update_rate's selection-only balancing bias).
    router_bias: bool = False
    # GPT-OSS: every expert's gate, up and down projections carry a bias. Needs every routed
    # assignment computed (dropless: capacity_factor null, ep_overflow rounds).
    expert_bias: bool = False
    clamped_swiglu: ClampedSwiglu | None = None  # null: the experts are plain SwiGLU
    aux_loss_weight: NonNegativeFloat = 0.0  # Switch-style load-balancing loss
    router_z_loss_weight: NonNegativeFloat = 0.0  # ST-MoE router logit z-loss
    # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for top-k
    # selection only, moved by `bias_update_rate` toward equal load after every step.
    bias_update_rate: NonNegativeFloat = 0.0  # 0 disables
    # null: dropless (tokens sorted by expert, grouped matmul). A number: each expert takes at
    # most capacity_factor * tokens * top_k / num_experts tokens per device; the rest drop.
    capacity_factor: PositiveFloat | None = None
    grouped_matmul: Literal["auto", "xla", "tokamax"] = "auto"  # auto: tokamax on GPU/TPU
    # tokamax's tiles for each projection (gate_up, down) and pass (forward, input_grad,
    # weight_grad); unnamed: tokamax's choice. The xla grouped matmul has no tiles.
    grouped_matmul_tiles: dict[Literal["gate_up", "down"], ProjectionTiles] = {}
    # Dropless with experts split over devices (mesh.expert > 1): how rows reach their experts
    # (parallel/experts.py). auto: ragged on GPU/TPU, all_to_all elsewhere.
    ep_dispatch: Literal["auto", "all_to_all", "ragged", "all_gather"] = "auto"
    # Its buffers hold this many times the routed rows per round (>= mesh.expert: one round,
    # worst-case buffers, P times the traffic).
    ep_capacity_factor: PositiveFloat = 1.25
    # What does not fit: rounds = sent in further rounds, nothing dropped (moe/rounds);
    # drop = dropped (moe/dropped), one round.
    ep_overflow: Literal["rounds", "drop"] = "rounds"
    # A diagnostic, not a way to train: every expert gets the same number of each device's
    # assignments (token n's j-th choice is expert (n k + j) mod E, weighted by the router's
    # scores for it), so a benchmark measures the step under the routing peers publish figures
    # for. The learned routing's imbalance is what it removes (moe/max_load, moe/rounds).
    balanced_routing: bool = False

    def is_moe_layer(self, layer: int) -> bool:
        """Whether model layer `layer` (0-based) is a mixture of experts."""
        return layer >= self.first_dense_layers and (layer + 1) % self.interval == 0

    @model_validator(mode="after")
    def _check_routing(self) -> MoeConfig:
        if self.top_k > self.num_experts:
            raise ValueError(
                f"model.moe.top_k ({self.top_k}) exceeds model.moe.num_experts ({self.num_experts})"
            )
        if self.num_experts % self.n_group:
            raise ValueError(
                f"model.moe.num_experts ({self.num_experts}) is not divisible into "
                f"model.moe.n_group ({self.n_group}) equal groups"
            )
        if self.topk_group > self.n_group:
            raise ValueError(
                f"model.moe.topk_group ({self.topk_group}) exceeds model.moe.n_group "
                f"({self.n_group})"
            )
        if self.shared_expert_gate and not self.shared_experts:
            raise ValueError("model.moe.shared_expert_gate needs model.moe.shared_experts >= 1")
        if self.expert_bias and (self.capacity_factor is not None or self.ep_overflow == "drop"):
            raise ValueError(
                "model.moe.expert_bias needs every routed assignment computed: "
                "model.moe.capacity_factor null and model.moe.ep_overflow rounds, not "
                f"capacity_factor {self.capacity_factor} and ep_overflow {self.ep_overflow}"
            )
        reachable = self.topk_group * self.experts_per_group
        if self.n_group > 1 and self.top_k > reachable:
            raise ValueError(
                f"model.moe.top_k ({self.top_k}) exceeds the {reachable} experts of "
                f"model.moe.topk_group ({self.topk_group}) groups of {self.experts_per_group}"
            )
        return self

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.n_group


class MtpConfig(Section):
    """Multi-token prediction (DeepSeek-V3, models/mtp.py): `depth` extra modules, module j
    predicting the token j + 1 places after the next; their mean loss, times `loss_weight`, is
    added to the training loss."""

    depth: int = Field(default=0, ge=0)  # 0 = off
    loss_weight: NonNegativeFloat = 0.3


class MlaConfig(Section):
    """Multi-head latent attention (DeepSeek-V2/V3; layers/mla.py): queries and keys/values
    through low-rank latents; each head's query/key is a per-head part without position plus a
    rotary part whose key is shared by all heads."""

    q_lora_rank: PositiveInt | None = None  # null: a plain query projection (DeepSeek-V2-Lite)
    kv_lora_rank: int = Field(gt=0)  # the key/value latent (what inference caches)
    qk_nope_head_dim: int = Field(gt=0)  # per head, without position
    qk_rope_head_dim: int = Field(gt=0, multiple_of=2)  # rotary part (key shared by all heads)
    v_head_dim: int = Field(gt=0)  # value head size; may differ from the query/key head size

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class LocalAttention(Section):
    """What a `local` layer of model.layer_pattern attends to (layers/attention_pattern.py):
    a sliding window of the last `window` positions (Gemma 3, GPT-OSS, Mistral) or its own
    chunk of `chunk` positions (Llama 4), always within its document. Exactly one of the two."""

    window: PositiveInt | None = None  # a query sees itself and the window - 1 keys before it
    chunk: PositiveInt | None = (
        None  # a query sees the earlier keys of its chunk (position // chunk)
    )
    # The local layers' RoPE base (Gemma 3: 10000 beside the global layers' 1M), without the
    # model's rope_scaling; null: the model's rope_theta and rope_scaling.
    rope_theta: PositiveFloat | None = None

    @model_validator(mode="after")
    def _check_one(self) -> LocalAttention:
        if (self.window is None) == (self.chunk is None):
            raise ValueError(
                "model.local_attention needs exactly one of window and chunk, got "
                f"window {self.window} and chunk {self.chunk}"
            )
        return self

    @property
    def span(self) -> int:
        """The most positions a local query reaches back, itself included."""
        return self.window or self.chunk


class LinearAttention(Section):
    """A `linear` layer of model.layer_pattern: Gated DeltaNet (Qwen3-Next), a recurrence over
    a fixed-size state per head in place of softmax attention (layers/gated_deltanet.py),
    whose cost grows linearly with the sequence. Query/key heads may be fewer than value heads
    (a divisor of them), as attention's key/value heads are."""

    num_key_heads: PositiveInt  # query and key heads
    num_value_heads: PositiveInt  # value heads (the state has one [key_head_dim, value_head_dim])
    key_head_dim: PositiveInt = 128
    value_head_dim: PositiveInt = 128
    conv_kernel: PositiveInt = 4  # taps of the causal depthwise convolution over q, k and v
    chunk: PositiveInt = 64  # training computes the recurrence in chunks of this many tokens

    @model_validator(mode="after")
    def _check_heads(self) -> LinearAttention:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"model.linear_attention.num_value_heads ({self.num_value_heads}) must be a "
                f"multiple of model.linear_attention.num_key_heads ({self.num_key_heads})"
            )
        return self


class GlobalAttention(Section):
    """What a `global` layer of model.layer_pattern (every layer, without a pattern) does besides
    attending to its whole document, where a family's global layers differ from the model's
    defaults: Llama 4's are NoPE layers, with no position encoding, no qk-norm and a query
    temperature that grows with the position (layers/attention_pattern.py)."""

    rope: bool = True  # false: no position encoding (NoPE)
    qk_norm: bool = True  # false: model.qk_norm leaves these layers alone
    # Attention temperature tuning (Llama 4): a query at position p is multiplied by
    # 1 + temperature_scale * ln(1 + floor((p + 1) / temperature_floor)); null: off.
    temperature_floor: PositiveInt | None = None
    temperature_scale: NonNegativeFloat = 0.1


class ModelArchitecture(Section):
    """The model itself: what its parameters' shapes and its function depend on. A model file
    (configs/models/<name>.yml) holds these keys; tools/convert_hf.py writes them."""

    vocab_size: int = Field(gt=0)
    emb_dim: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: PositiveInt | None = None  # None: emb_dim // num_heads
    mlp_dim: int = Field(gt=0)
    rope_theta: PositiveFloat = 10000.0
    rope_scaling: RopeScaling | None = None
    # Which dims rotate together: false pairs dim i with i + H/2 (Llama, Qwen); true pairs
    # 2i with 2i + 1 (DeepSeek checkpoints).
    rope_interleaved: bool = False
    # Partial RoPE (GLM-4.5: 0.5): the first partial_rotary_factor x head_dim dims of each
    # query/key head rotate (pairing as above, among themselves); the rest carry no position.
    partial_rotary_factor: float = Field(default=1.0, gt=0, le=1)
    # gqa: grouped-query attention (layers/attention.py); mla: multi-head latent attention
    # (layers/mla.py), shaped by the `mla` section (num_kv_heads and head_dim are then
    # unused).
    attention_type: Literal["gqa", "mla"] = "gqa"
    mla: MlaConfig | None = None
    qk_norm: bool = False
    # false: the qk-norm has no learned scale (Llama 4's, an RMS norm of each head alone).
    qk_norm_scale: bool = True
    # The attention logits are divided by sqrt(this) instead of sqrt(head_dim) (Gemma 3's
    # query_pre_attn_scalar; grouped-query attention); null: sqrt(head_dim).
    softmax_scale_dim: PositiveInt | None = None
    # Which projections of (grouped-query) attention carry a bias: GLM-4.5 and Qwen2 have q, k
    # and v biases; GPT-OSS has the output's too.
    attention_bias: Literal["none", "qkv", "qkvo"] = "none"
    # GPT-OSS: a learned logit per query head that joins the softmax's denominator and carries
    # no value (kernels/attention.py masked_attention), so a head may attend to nothing.
    attention_sinks: bool = False
    # Qwen3-Next: the attention output, per head and dim, times sigmoid of a gate projected
    # from the layer's input (x W_gate [D, N, H]), before the output projection.
    attention_output_gate: bool = False
    # The layers' attention kinds, repeated over the layers: e.g. [local, local, local, local,
    # local, global] is Gemma 3's "5 local : 1 global". Absent: every layer global (causal over
    # its whole document). `local` is shaped by local_attention.
    # `linear` layers are Gated DeltaNet (linear_attention) instead of softmax attention:
    # Qwen3-Next's [linear, linear, linear, global].
    layer_pattern: list[Literal["global", "local", "linear"]] | None = Field(
        default=None, min_length=1
    )
    local_attention: LocalAttention | None = None
    linear_attention: LinearAttention | None = None
    global_attention: GlobalAttention | None = None  # null: as the model's defaults say
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

    @model_validator(mode="after")
    def _check_heads(self) -> ModelArchitecture:
        if (self.attention_type == "mla") != (self.mla is not None):
            raise ValueError(
                f"model.attention_type is {self.attention_type} but model.mla is "
                f"{'set' if self.mla else 'absent'}; the mla section goes with attention_type mla"
            )
        if self.mla is not None and self.qk_norm:
            raise ValueError("model.qk_norm is not supported with attention_type mla")
        if self.mla is not None and self.softmax_scale_dim is not None:
            raise ValueError("model.softmax_scale_dim is not supported with attention_type mla")
        if self.moe is not None and self.mlp_activation != "silu":
            raise ValueError(
                f"model.mlp_activation {self.mlp_activation} is not supported with model.moe "
                "(the experts are SwiGLU)"
            )
        if self.mla is not None and self.attention_sinks:
            raise ValueError("model.attention_sinks needs attention_type gqa, not mla")
        if self.mla is not None and self.attention_output_gate:
            raise ValueError("model.attention_output_gate needs attention_type gqa, not mla")
        uses_local = "local" in (self.layer_pattern or ())
        if uses_local != (self.local_attention is not None):
            raise ValueError(
                f"model.layer_pattern {'has' if uses_local else 'has no'} local layers but "
                f"model.local_attention is {'absent' if uses_local else 'set'}; the "
                "local_attention section goes with local layers"
            )
        uses_linear = "linear" in (self.layer_pattern or ())
        if uses_linear != (self.linear_attention is not None):
            raise ValueError(
                f"model.layer_pattern {'has' if uses_linear else 'has no'} linear layers but "
                f"model.linear_attention is {'absent' if uses_linear else 'set'}; the "
                "linear_attention section goes with linear layers"
            )
        if uses_local and self.attention_type == "mla":
            raise ValueError("model.layer_pattern's local layers need attention_type gqa, not mla")
        if self.global_attention is not None and self.attention_type == "mla":
            raise ValueError("model.global_attention needs attention_type gqa, not mla")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads ({self.num_heads}) must be a multiple of "
                f"model.num_kv_heads ({self.num_kv_heads})"
            )
        if self.moe is not None and not any(map(self.moe.is_moe_layer, range(self.num_layers))):
            raise ValueError(
                f"model.moe makes no layer a mixture of experts: first_dense_layers "
                f"({self.moe.first_dense_layers}) and interval ({self.moe.interval}) leave all "
                f"{self.num_layers} layers dense"
            )
        if self.head_dim is None and self.emb_dim % self.num_heads:
            raise ValueError(
                f"model.emb_dim ({self.emb_dim}) is not divisible by model.num_heads "
                f"({self.num_heads}); set model.head_dim explicitly"
            )
        if self.partial_rotary_factor != 1:
            self._check_partial_rotary()
        return self

    def _check_partial_rotary(self) -> None:
        if self.attention_type == "mla":
            raise ValueError(
                "model.partial_rotary_factor applies to attention_type gqa; multi-head latent "
                "attention rotates model.mla.qk_rope_head_dim dims"
            )
        rotated = self.resolved_head_dim * self.partial_rotary_factor
        if rotated != int(rotated) or int(rotated) % 2:
            raise ValueError(
                f"model.partial_rotary_factor ({self.partial_rotary_factor}) x head_dim "
                f"({self.resolved_head_dim}) = {rotated:g} dims to rotate, not an even number"
            )

    def layer_attention(self, layer: int) -> str:
        """Model layer `layer`'s (0-based) kind in model.layer_pattern: "global", "local" or
        "linear"."""
        pattern = self.layer_pattern or ("global",)
        return pattern[layer % len(pattern)]

    def layer_mixer(self, layer: int) -> Mixer:
        """Model layer `layer`'s (0-based) token mixer, which picks its parameter stack
        (models/stacks.py): softmax "attention", or "linear" attention (a recurrence) for the
        `linear` layers of model.layer_pattern."""
        return "linear" if self.layer_attention(layer) == "linear" else "attention"

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.emb_dim // self.num_heads


class ModelConfig(ModelArchitecture):
    """The `model:` section of a run: the architecture, and how this run initialises, stores
    and computes it (the schema holds their defaults: configs/reference.yml)."""

    init_std: NonNegativeFloat = 0.02
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    scan_layers: bool = True
    remat: Literal["none", "full", "minimal"] = "full"
    # auto: splash on TPU, mosaic_gpu on GPU, xla elsewhere, by the platform of the devices the
    # run is built for; mosaic: tokamax's mosaic_gpu or mosaic_tpu (kernels/attention.py)
    attention: Literal[
        "auto",
        "xla",
        "splash",
        "mosaic",
        "mosaic_gpu",
        "mosaic_tpu",
        "cudnn",
        "triton",
        "xla_chunked",
        "tokamax_xla",
    ] = "auto"
    # Each attention head's largest pre-softmax logit over the step's batch, as a statistic
    # (metric attention/max_logit; QK-clip reads it: optim.qk_clip_threshold turns it on).
    # Only the xla kernel computes it (kernels/attention.py).
    attention_max_logit: bool = False
    # With mesh.context > 1 (parallel/context.py): how keys/values reach the queries,
    # and how the sequence is cut over the devices.
    context_exchange: Literal["all_gather", "ring"] = "all_gather"
    context_layout: Literal["balanced", "contiguous"] = "balanced"
