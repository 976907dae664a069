"""Activation quantization kernels for FP8 W8A8 projections."""

from . import rmsnorm_fp8, rows_fp8, swiglu_fp8
from .reference import (
    FP8_DTYPE,
    FP8_MAX,
    quantize_rows_fp8,
    rmsnorm_quantize_fp8_reference,
    swiglu_quantize_fp8_reference,
)
from .rmsnorm_fp8 import rmsnorm_quantize_fp8
from .rows_fp8 import quantize_rows_fp8_kernel
from .swiglu_fp8 import swiglu_quantize_fp8, unsupported

__all__ = ["FP8_DTYPE", "FP8_MAX", "quantize_rows_fp8", "quantize_rows_fp8_kernel",
           "rmsnorm_fp8", "rmsnorm_quantize_fp8", "rmsnorm_quantize_fp8_reference", "rows_fp8",
           "swiglu_fp8", "swiglu_quantize_fp8", "swiglu_quantize_fp8_reference", "unsupported"]
