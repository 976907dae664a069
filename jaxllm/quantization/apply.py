"""Load-time quantization: a float param leaf becomes its quantized stand-in
(:mod:`jaxllm.layers.linear`), one leaf at a time, on the device(s) that hold it, keeping its
tensor-parallel split (the scale split as the kernel's output axis)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxllm.layers.fp8 import Fp8Weight, quantize_fp8
from jaxllm.layers.linear import PER_WORD, Int4Weight, Int8Weight, quantize_int8
from jaxllm.parallel.sharding import param_spec, path_names
from jaxllm.quantization.config import INT4_METHODS, QuantizationConfig

# The decoder's projections; the embedding and the LM head stay in the compute dtype (as vLLM
# keeps lm_head unquantized by default).
QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# method -> (the stand-in's type, the load-time quantizer of a float kernel)
QUANTIZERS = {"int8": (Int8Weight, quantize_int8), "fp8": (Fp8Weight, quantize_fp8)}


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
    _, quantize = QUANTIZERS[config.method]
    sharding = getattr(leaf, "sharding", None)
    out = {}
    if isinstance(sharding, NamedSharding):  # each part where the sharding table puts it
        out = {"out_shardings": jax.tree_util.tree_map_with_path(
            lambda part, x: NamedSharding(sharding.mesh, param_spec((*path, *part), x.shape)),
            jax.eval_shape(quantize, leaf))}
    quantized = jax.jit(quantize, **out)(leaf)
    if donate and not isinstance(leaf, jax.core.Tracer):  # traced: shapes only (eval_shape)
        leaf.delete()
    return quantized


def stand_in_shape(path: tuple, leaf: Any, config: QuantizationConfig | None) -> Any:
    """What the float param ``leaf`` becomes under ``config``, for its shapes and dtypes only
    (call it under ``jax.eval_shape``: ``jaxllm convert``'s restore target): a load-time
    quantizer's stand-in, or the packed :class:`Int4Weight` a 4-bit checkpoint is read into
    (zero-filled: its values come from the checkpoint, never from floats)."""
    if config is None or config.method not in INT4_METHODS or not is_quantized_linear(path):
        return quantize_leaf(path, leaf, config)
    *lead, k, n = leaf.shape
    groups = 1 if config.group_size == -1 else k // config.group_size
    return Int4Weight(qweight=jnp.zeros((*lead, k // PER_WORD, n), jnp.int32),
                      scales=jnp.zeros((*lead, groups, n), leaf.dtype),
                      zeros=jnp.zeros((*lead, groups, n), jnp.uint8))


def quantize_params(params: Any, config: QuantizationConfig | None, *,
                    donate: bool = False) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: quantize_leaf(path, leaf, config, donate=donate), params)
