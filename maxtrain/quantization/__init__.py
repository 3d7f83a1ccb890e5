"""Quantization: quantized training from the config (training.py) and post-training
quantization of a checkpoint's parameters (ptq.py, for tools/quantize.py)."""

from maxtrain.quantization.ptq import (
    contraction_axes,
    dequantize_params,
    quantizable_kernels,
    quantize_params,
)
from maxtrain.quantization.training import PRESETS, module_paths, quantize, rules

__all__ = [
    "PRESETS",
    "contraction_axes",
    "dequantize_params",
    "module_paths",
    "quantizable_kernels",
    "quantize",
    "quantize_params",
    "rules",
]
