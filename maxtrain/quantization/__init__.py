"""Quantization: quantized training from the config (training.py) and post-training
quantization of a checkpoint's parameters (ptq.py, for tools/quantize.py)."""

from maxtrain.quantization.ptq import (
    contraction_axes,
    dequantize_params,
    load_parameters_dequantized,
    quantizable_kernels,
    quantize_params,
    quantized_kind,
)
from maxtrain.quantization.training import PRESETS, module_paths, quantize, rules

__all__ = [
    "PRESETS",
    "contraction_axes",
    "dequantize_params",
    "load_parameters_dequantized",
    "module_paths",
    "quantizable_kernels",
    "quantize",
    "quantize_params",
    "quantized_kind",
    "rules",
]
