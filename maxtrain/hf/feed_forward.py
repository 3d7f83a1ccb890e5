"""The feed-forward aspects families share: the dense SwiGLU, and routed experts with their
router, routing bias and shared experts, stored one tensor per expert (Mixtral, Qwen3-MoE,
DeepSeek-V3, GLM-4.5, Qwen3-Next). Llama 4 and GPT-OSS store their experts otherwise
(families/llama4.py, families/gpt_oss.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from maxtrain.config import LayerType, ModelConfig
from maxtrain.hf.aspect import Aspect, HfConfig
from maxtrain.hf.layout import LayerSite, Slot

PROJECTIONS = ("gate", "up", "down")  # ours, in the order of a SwiGLU's Hugging Face names
# The aux-loss-free bias update rate an imported routing bias trains with: DeepSeek-V3's
# published gamma (its paper, section 2.1.2); the checkpoint does not record it.
IMPORTED_BIAS_UPDATE_RATE = 0.001


@dataclass(frozen=True)
class DenseMlp(Aspect):
    """The dense layers' SwiGLU, `<block>.{gate,up,down}_proj`, of width `width_key`."""

    block: str = "mlp"
    width_key: str = "intermediate_size"
    owns: frozenset[str] = frozenset({"mlp_dim"})

    def read(self, hf: HfConfig, layers: Sequence[LayerType]) -> dict[str, Any]:
        if all(t.ffn == "moe" for t in layers):
            return {}
        return {"mlp_dim": hf[self.width_key]}

    def write(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        """The width; without dense layers (the key unread) transformers' default, or the
        experts' width."""
        if cfg.mlp_dim is not None:
            return {self.width_key: cfg.mlp_dim}
        assert cfg.moe is not None  # a model without dense layers has experts
        return {self.width_key: defaults.get(self.width_key, cfg.moe.expert_mlp_dim)}

    def tensors(self, cfg: ModelConfig, site: LayerSite) -> list[Slot]:
        if site.is_moe:
            return []
        return [
            site.slot(f"{self.block}.{ours}_proj.weight", ("mlp", ours, "kernel"), 1)
            for ours in PROJECTIONS
        ]


@dataclass(frozen=True)
class Experts(Aspect):
    """model.moe's routed experts: how many (the first of `count_keys` present; export
    writes the first), top k, their width, and what else config.json keys map; in a MoE
    layer's `block`, the router `<router>.weight` (with the routing bias `router_bias`:
    aux-loss-free balancing), the shared experts' SwiGLU `shared_block` (with its gate
    `<shared_block>_gate`: Qwen3-Next) and one SwiGLU per expert, `experts.<e>.<names>`."""

    count_keys: tuple[str, ...]
    width_key: str
    block: str = "mlp"
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    router: str = "gate"
    renormalize_key: str | None = None  # None: the top-k weights as model.moe's default
    aux_key: str | None = "router_aux_loss_coef"  # -> model.moe.aux_loss_weight
    keys: Mapping[str, str] = field(default_factory=dict)  # config.json key -> model.moe key
    router_bias: str | None = None
    shared_block: str | None = None

    @property
    def owns(self) -> frozenset[str]:  # type: ignore[override]
        mapped = ["num_experts", "top_k", "expert_mlp_dim", *self.keys.values()]
        mapped += ["aux_loss_weight"] if self.aux_key else []
        mapped += ["renormalize"] if self.renormalize_key else []
        mapped += ["balance_bias_update_rate"] if self.router_bias else []
        return frozenset(f"moe.{key}" for key in mapped)

    def read(self, hf: HfConfig, layers: Sequence[LayerType]) -> dict[str, Any]:
        count_key = next((k for k in self.count_keys if k in hf), self.count_keys[0])
        moe = dict(
            num_experts=hf[count_key],
            top_k=hf["num_experts_per_tok"],
            expert_mlp_dim=hf[self.width_key],
            **{ours: hf[key] for key, ours in self.keys.items()},
        )
        if self.aux_key:
            moe["aux_loss_weight"] = hf[self.aux_key]
        if self.renormalize_key:
            moe["renormalize"] = hf[self.renormalize_key]
        if self.router_bias:
            moe["balance_bias_update_rate"] = IMPORTED_BIAS_UPDATE_RATE
        return {"moe": moe}

    def write(self, cfg: ModelConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
        m = cfg.moe
        assert m is not None  # unexpressed refuses a dense model first
        out = {
            self.count_keys[0]: m.num_experts,
            "num_experts_per_tok": m.top_k,
            self.width_key: m.expert_mlp_dim,
            **{key: getattr(m, ours) for key, ours in self.keys.items()},
        }
        if self.aux_key:
            out[self.aux_key] = m.aux_loss_weight
        if self.renormalize_key:
            out[self.renormalize_key] = m.renormalize
        return out

    def unexpressed(self, cfg: ModelConfig) -> list[str]:
        if cfg.moe is None:
            return ["a dense model (its MoE layers are required)"]
        rate = cfg.moe.balance_bias_update_rate
        if self.router_bias and rate == 0:
            return [f"model.moe.balance_bias_update_rate={rate} (a routing bias)"]
        return []

    def tensors(self, cfg: ModelConfig, site: LayerSite) -> list[Slot]:
        if not site.is_moe:
            return []
        assert cfg.moe is not None  # a MoE layer implies it
        router, at = f"{self.block}.{self.router}.", ("moe", "router")
        out = [site.slot(router + "weight", (*at, "kernel"), 1)]
        if self.router_bias:
            out.append(site.slot(router + self.router_bias, (*at, "bias"), None))
        if self.shared_block and cfg.moe.shared_experts:
            shared = f"{self.block}.{self.shared_block}."
            out += [
                site.slot(f"{shared}{ours}_proj.weight", ("moe", "shared", ours, "kernel"), 1)
                for ours in PROJECTIONS
            ]
        if cfg.moe.shared_expert_gate:
            gate = f"{self.block}.{self.shared_block}_gate.weight"
            out.append(site.slot(gate, ("moe", "shared_gate", "kernel"), 1))
        return out + self.expert_tensors(cfg, site)

    def expert_tensors(self, cfg: ModelConfig, site: LayerSite) -> list[Slot]:
        """The routed experts' tensors: one SwiGLU per expert, as torch Linear weights."""
        assert cfg.moe is not None
        return [
            site.slot(f"{self.block}.experts.{e}.{name}.weight", ("moe", ours, "kernel"), 1,
                      expert=e)
            for e in range(cfg.moe.num_experts)
            for ours, name in zip(PROJECTIONS, self.names, strict=True)
        ]  # fmt: skip
