"""Quantized weights: which method a checkpoint or flag asks for (:mod:`.config`) and how the
float params become quantized ones at load time (:mod:`.apply`). The matmuls live in
:mod:`jaxllm.layers.linear`."""

from jaxllm.quantization.apply import quantize_leaf, quantize_params
from jaxllm.quantization.config import (
    QUANTIZATION_METHODS,
    QUANTIZATION_NAMES,
    QuantizationConfig,
    quantization_method,
    resolve_quantization,
)

__all__ = ["QUANTIZATION_METHODS", "QUANTIZATION_NAMES", "QuantizationConfig",
           "quantization_method", "quantize_leaf", "quantize_params", "resolve_quantization"]
