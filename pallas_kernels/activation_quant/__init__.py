"""Activation quantization kernels for FP8 W8A8 projections."""

from .reference import FP8_DTYPE, FP8_MAX, swiglu_quantize_fp8_reference
from .swiglu_fp8 import swiglu_quantize_fp8, unsupported

__all__ = ["FP8_DTYPE", "FP8_MAX", "swiglu_quantize_fp8", "swiglu_quantize_fp8_reference",
           "unsupported"]
