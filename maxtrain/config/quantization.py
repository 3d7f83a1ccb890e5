"""The `quantization:` section: quantized training from presets and rules."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from maxtrain.config.domains import Section

# Quantized dtypes a rule may name (int4 is meant for weights: too coarse for activations).
QType = Literal["int8", "int4", "float8_e4m3fn", "float8_e5m2"]
# absmax[,s] | minmax[,s] | rms,s | fixed,lo,hi: how a tensor's range (hence scale) is chosen.
_NUM = r"[0-9.eE+-]+"
_CALIBRATION = re.compile(rf"(absmax|minmax)(,{_NUM})?|rms,{_NUM}|fixed,{_NUM},{_NUM}")


class QuantRule(Section):
    """Quantization of the matmuls in the modules whose path matches `module_path`.

    Paths are module attribute paths joined by '/', e.g. layers/attn/q, layers/mlp/down,
    moe_layers/moe (the experts' grouped matmuls and the router), lm_head; '' is the decoder
    itself (the tied-embedding logits). A qtype left null keeps that operand in compute dtype.
    """

    module_path: str  # regex, matched against the whole path
    op_names: list[Literal["einsum", "dot_general", "ragged_dot"]] = Field(default_factory=list)
    weight_qtype: QType | None = None
    act_qtype: QType | None = None
    bwd_qtype: QType | None = None  # gradients in the backward pass (training only)
    tile_size: int | None = Field(default=None, gt=0)  # sub-channel scales every N inputs
    weight_calibration: str = "absmax"
    act_calibration: str = "absmax"

    @model_validator(mode="after")
    def _check(self) -> QuantRule:
        try:
            re.compile(self.module_path)
        except re.error as e:
            raise ValueError(
                f"quantization.rules: module_path {self.module_path!r} is not a valid regex ({e})"
            ) from None
        for name in ("weight_calibration", "act_calibration"):
            if not _CALIBRATION.fullmatch(getattr(self, name)):
                raise ValueError(
                    f"quantization.rules: {name} {getattr(self, name)!r} is not one of "
                    "absmax[,scale], minmax[,scale], rms,scale, fixed,min,max"
                )
        if self.tile_size is not None and self.op_names == ["ragged_dot"]:
            raise ValueError(
                "quantization.rules: tile_size does not apply to ragged_dot (the experts take "
                "one scale per expert and output channel); drop it or add einsum/dot_general"
            )
        return self


class QuantizationConfig(Section):
    """Quantized training of the matmuls (maxtrain/quantization/); parameters stay float."""

    preset: Literal["none", "int8", "fp8", "w4a16-serving"] = "none"
    # Checked in order before the preset's own rules: the first rule matching a matmul wins.
    rules: list[QuantRule] = Field(default_factory=list)
