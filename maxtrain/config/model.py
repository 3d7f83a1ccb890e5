"""The `model:` section: the architecture (what parameters' shapes and the function depend on)
and the run-time keys of how a run initialises, stores and computes it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from maxtrain.config.domains import NonNegativeFloat, PositiveFloat, PositiveInt, Section


class RopeScaling(Section):
    """Llama-3 style RoPE frequency scaling (absent = no scaling)."""

    factor: PositiveFloat = 8.0
    low_freq_factor: PositiveFloat = 1.0
    high_freq_factor: PositiveFloat = 4.0
    original_max_position: PositiveInt = 8192

    @model_validator(mode="after")
    def _check_band(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"model.rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                f"model.rope_scaling.low_freq_factor ({self.low_freq_factor})"
            )
        return self


class MoeConfig(Section):
    """Mixture-of-experts feed-forward layers (absent = a dense model)."""

    num_experts: int = Field(gt=0)
    top_k: int = Field(gt=0)
    expert_mlp_dim: int = Field(gt=0)  # hidden size of each routed expert (SwiGLU)
    shared_experts: int = Field(default=0, ge=0)  # always-on experts, fused into one SwiGLU
    score: Literal["softmax", "sigmoid"] = "softmax"  # router score function
    renormalize: bool = True  # rescale the top-k weights to sum to 1
    routed_scale: PositiveFloat = 1.0  # multiplies the routed experts' output
    # Which layers are MoE: layer i (0-based) is MoE iff i >= first_dense_layers and
    # (i + 1) % interval == 0. interval 1 = every layer; 2 = every second layer (1, 3, ...).
    first_dense_layers: int = Field(default=0, ge=0)
    interval: int = Field(default=1, gt=0)
    aux_loss_weight: NonNegativeFloat = 0.0  # Switch-style load-balancing loss
    router_z_loss_weight: NonNegativeFloat = 0.0  # ST-MoE router logit z-loss
    # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for top-k
    # selection only, moved by `bias_update_rate` toward equal load after every step.
    bias_update_rate: NonNegativeFloat = 0.0  # 0 disables
    # null: dropless (tokens sorted by expert, grouped matmul). A number: each expert takes at
    # most capacity_factor * tokens * top_k / num_experts tokens per device; the rest drop.
    capacity_factor: PositiveFloat | None = None
    grouped_matmul: Literal["auto", "xla", "tokamax"] = "auto"  # auto: tokamax on GPU/TPU
    # Dropless with experts split over devices (mesh.expert > 1): how rows reach their experts
    # (layers/expert_parallel.py). auto: ragged on GPU/TPU, all_to_all elsewhere.
    ep_dispatch: Literal["auto", "all_to_all", "ragged", "all_gather"] = "auto"
    # Its buffers hold this many times the routed rows; rows beyond are dropped (moe/dropped).
    # >= mesh.expert never drops (worst-case buffers, P times the traffic).
    ep_capacity_factor: PositiveFloat = 1.25

    def is_moe_layer(self, layer: int) -> bool:
        """Whether model layer `layer` (0-based) is a mixture of experts."""
        return layer >= self.first_dense_layers and (layer + 1) % self.interval == 0

    @model_validator(mode="after")
    def _check_routing(self) -> MoeConfig:
        if self.top_k > self.num_experts:
            raise ValueError(
                f"model.moe.top_k ({self.top_k}) exceeds model.moe.num_experts ({self.num_experts})"
            )
        return self


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
    qk_norm: bool = False
    tie_embeddings: bool = False
    norm_eps: PositiveFloat = 1e-5
    max_seq_len: PositiveInt = 8192
    moe: MoeConfig | None = None

    @model_validator(mode="after")
    def _check_heads(self) -> ModelArchitecture:
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
        return self

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.emb_dim // self.num_heads


class ModelConfig(ModelArchitecture):
    """The `model:` section of a run: the architecture, and how this run initialises, stores
    and computes it (configs/base.yml sets these run-time keys)."""

    init_std: NonNegativeFloat = 0.02
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    scan_layers: bool = True
    remat: Literal["none", "full", "minimal"] = "full"
    attention: Literal["auto", "xla", "mosaic", "cudnn", "triton", "xla_chunked", "tokamax_xla"] = (
        "auto"
    )
    # With mesh.context > 1 (layers/context_parallel.py): how keys/values reach the queries,
    # and how the sequence is cut over the devices.
    context_exchange: Literal["all_gather", "ring"] = "all_gather"
    context_layout: Literal["balanced", "contiguous"] = "balanced"
