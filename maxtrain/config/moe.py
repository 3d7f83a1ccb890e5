"""The `model.moe:` section: mixture-of-experts feed-forward layers, what they compute (which
layers are MoE is model.layers; how the experts' rows are exchanged and multiplied is
`compute:`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from maxtrain.config.domains import NonNegativeFloat, PositiveFloat, PositiveInt, Section


class ClampedSwiglu(Section):
    """GPT-OSS's experts' activation in place of SwiGLU's silu(gate) * up: the gate clamped
    above at `limit`, the up projection to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate) (layers/activations.py)."""

    alpha: PositiveFloat = 1.702
    limit: PositiveFloat = 7.0


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
    # GPT-OSS: the router's linear map has a bias, added to its logits and trained like a
    # weight (not balance_bias_update_rate's selection-only balancing bias).
    router_logit_bias: bool = False
    # GPT-OSS: every expert's gate, up and down projections carry a bias. Needs every routed
    # assignment computed (dropless: expert_capacity_factor null, and
    # compute.expert_exchange_overflow rounds).
    expert_projection_bias: bool = False
    clamped_swiglu: ClampedSwiglu | None = None  # null: the experts are plain SwiGLU
    aux_loss_weight: NonNegativeFloat = 0.0  # Switch-style load-balancing loss
    router_z_loss_weight: NonNegativeFloat = 0.0  # ST-MoE router logit z-loss
    # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for top-k
    # selection only, moved by this rate toward equal load after every step. 0 disables.
    balance_bias_update_rate: NonNegativeFloat = 0.0
    # null: dropless (tokens sorted by expert, grouped matmul). A number: each expert takes at
    # most expert_capacity_factor * tokens * top_k / num_experts tokens per device; the rest
    # drop.
    expert_capacity_factor: PositiveFloat | None = None

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
        if self.expert_projection_bias and self.expert_capacity_factor is not None:
            raise ValueError(
                "model.moe.expert_projection_bias needs every routed assignment computed: "
                "model.moe.expert_capacity_factor null, not "
                f"{self.expert_capacity_factor}"
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
