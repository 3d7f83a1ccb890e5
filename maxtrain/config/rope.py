"""The `model.rope:` section: rotary position embeddings, everything about them in one place
(layers/rope.py computes them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from maxtrain.config.domains import NonNegativeFloat, PositiveFloat, PositiveInt, Section


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
                f"model.rope.scaling.high_freq_factor ({self.high_freq_factor}) must be at "
                f"least model.rope.scaling.low_freq_factor ({self.low_freq_factor})"
            )
        return self


class RopeConfig(Section):
    """How positions enter attention: the base, its scaling, which dims rotate together and
    how many, and the base of the local (sliding or chunked) layers."""

    theta: PositiveFloat = 10000.0  # the base of the frequencies
    scaling: RopeScaling | None = None  # null: none
    # Which dims rotate together: false pairs dim i with i + H/2 (Llama, Qwen); true pairs
    # 2i with 2i + 1 (DeepSeek checkpoints).
    interleaved: bool = False
    # Partial RoPE (GLM-4.5: 0.5): the first fraction x head_dim dims of each query/key head
    # rotate (pairing as above, among themselves); the rest carry no position.
    fraction: float = Field(default=1.0, gt=0, le=1)
    # The sliding and chunked layers' base (Gemma 3: 10000 beside the global layers' 1M),
    # without `scaling`; null: theta and scaling, as the global layers.
    local_theta: PositiveFloat | None = None
