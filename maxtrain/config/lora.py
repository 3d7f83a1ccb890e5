"""The `lora:` section: low-rank adapters on a frozen base model (LoRA), optionally with the
base stored quantized (QLoRA). maxtrain/posttrain/lora.py builds and applies them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from maxtrain.config.domains import PositiveFloat, Section

# Which matmuls get adapters: attention's projections (q, k, v, o; MLA's q_a, q_b, kv_a, kv_b),
# the dense SwiGLU's and the shared experts' gate/up/down, the routed experts' gate/up/down.
LoraModule = Literal["attention", "mlp", "experts"]


class LoraConfig(Section):
    """Low-rank adapters on a frozen base model (LoRA; QLoRA with the base quantized)."""

    rank: int = Field(default=0, ge=0)  # 0: no adapters (every parameter trains)
    alpha: PositiveFloat = 16.0  # the adapters' output is scaled by alpha / rank
    modules: list[LoraModule] = Field(default=["attention", "mlp"], min_length=1)
    # QLoRA: the frozen base's layer kernels stored quantized (absmax scales per block of
    # block_size inputs along the last input axis, or per output channel where block_size does
    # not divide it), dequantized one layer at a time as the layers run
    base_quantization: Literal["none", "int8", "int4", "nf4"] = "none"
    block_size: int = Field(default=64, gt=0)

    @model_validator(mode="after")
    def _check(self) -> LoraConfig:
        if len(set(self.modules)) != len(self.modules):
            raise ValueError(f"lora.modules lists a module twice: {self.modules}")
        return self

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
