"""Model building blocks shared by the model families."""

from jaxllm.layers.linear import Int8Weight, Linear, linear, quantize_int8

__all__ = ["Int8Weight", "Linear", "linear", "quantize_int8"]
