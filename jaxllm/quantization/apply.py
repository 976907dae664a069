"""Load-time quantization: a float param leaf becomes its quantized stand-in
(:mod:`jaxllm.layers.linear`), one leaf at a time, on the device(s) that hold it, keeping its
tensor-parallel split (the scale split as the kernel's output axis)."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.layers.linear import Int8Weight, quantize_int8
from jaxllm.quantization.config import QuantizationConfig

# The decoder's projections; the embedding and the LM head stay in the compute dtype (as vLLM
# keeps lm_head unquantized by default).
QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


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
    if config is None or not is_quantized_linear(path) or isinstance(leaf, Int8Weight):
        return leaf
    if config.method != "int8":
        raise ValueError(f"{config.describe()}: no load-time quantizer")
    sharding = getattr(leaf, "sharding", None)
    out = {}
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))
        out = {"out_shardings": Int8Weight(
            q=sharding, scale=NamedSharding(sharding.mesh, PartitionSpec(*spec[:-2], spec[-1])))}
    quantized = jax.jit(quantize_int8, **out)(leaf)
    if donate:
        leaf.delete()
    return quantized


def quantize_params(params: Any, config: QuantizationConfig | None, *,
                    donate: bool = False) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: quantize_leaf(path, leaf, config, donate=donate), params)
