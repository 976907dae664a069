"""Model building blocks shared by the model families."""

from jaxllm.layers.fp8 import Fp8Weight, quantize_fp8
from jaxllm.layers.linear import Int8Weight, Linear, linear, quantize_int8

__all__ = ["Fp8Weight", "Int8Weight", "Linear", "linear", "quantize_fp8", "quantize_int8"]
