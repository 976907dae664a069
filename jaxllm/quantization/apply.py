"""Load-time quantization: a float param leaf becomes its quantized stand-in
(:mod:`jaxllm.layers.linear`), one leaf at a time, on the device(s) that hold it, keeping its
tensor-parallel split (the scale split as the kernel's output axis)."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.layers.linear import Fp8Weight, Int8Weight, quantize_fp8, quantize_int8
from jaxllm.quantization.config import QuantizationConfig

# The decoder's projections; the embedding and the LM head stay in the compute dtype (as vLLM
# keeps lm_head unquantized by default).
QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# method -> (the stand-in's type, the load-time quantizer of a float kernel)
QUANTIZERS = {"int8": (Int8Weight, quantize_int8), "fp8": (Fp8Weight, quantize_fp8)}


def path_names(path: tuple) -> list:
    return [getattr(k, "key", getattr(k, "name", None)) for k in path]


def is_quantized_linear(path: tuple) -> bool:
    names = path_names(path)
    return len(names) >= 2 and names[-1] == "kernel" and names[-2] in QUANTIZED_LINEARS


def quantize_leaf(path: tuple, leaf: jax.Array, config: QuantizationConfig | None, *,
                  donate: bool = False) -> Any:
    """``leaf`` quantized when ``config`` asks and it is a quantized projection's kernel;
    else ``leaf``. ``donate``: the float leaf is freed once quantized (the loaders: peak
    memory stays at one float leaf)."""
    stand_ins = tuple(kind for kind, _ in QUANTIZERS.values())
    if config is None or not is_quantized_linear(path) or isinstance(leaf, stand_ins):
        return leaf
    if config.method not in QUANTIZERS:
        raise ValueError(f"{config.describe()}: no load-time quantizer")
    stand_in, quantize = QUANTIZERS[config.method]
    sharding = getattr(leaf, "sharding", None)
    out = {}
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))
        out = {"out_shardings": stand_in(
            q=sharding, scale=NamedSharding(sharding.mesh, PartitionSpec(*spec[:-2], spec[-1])))}
    quantized = jax.jit(quantize, **out)(leaf)
    if donate:
        leaf.delete()
    return quantized


def quantize_params(params: Any, config: QuantizationConfig | None, *,
                    donate: bool = False) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: quantize_leaf(path, leaf, config, donate=donate), params)
