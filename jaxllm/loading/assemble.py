"""Turns Hugging Face-named tensors into the model's param tree, streamed per tensor and, under
tensor parallelism, per shard.

Every source (safetensors directory, GGUF file) exposes tensors under Hugging Face names with
Hugging Face layouts ([out, in] for linear weights); this module checks each shape against
the config and builds the tree documented in :mod:`jaxllm.models.llama` (its fused column
orders included). Each leaf is described by a :class:`Leaf` that reads any block of it from
the source; a device's shard is read straight from the (memory-mapped) tensors, so no leaf is
ever whole in host memory unless one device holds it whole. Float leaves also make their
blocks on the device from the stored rows (:mod:`jaxllm.loading.device_blocks`), the path
loading takes; their host reads are its spec.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm.errors import ModelLoadError
from jaxllm.layers.fp8 import FP8_DTYPE, Fp8Weight
from jaxllm.layers.linear import PER_WORD, Int4Weight
from jaxllm.loading.device_blocks import fused_block, on_device
from jaxllm.model_config import ModelConfig
from jaxllm.parallel.mesh import PP_AXIS
from jaxllm.parallel.sharding import path_names
from jaxllm.quantization.config import INT4_METHODS, QuantizationConfig
from jaxllm.quantization.int4_checkpoint import (
    Int4Linear,
    group_size,
    linear_in_out,
    tensor_shapes,
)

GetTensor = Callable[[str], np.ndarray]
Index = tuple[slice, ...]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One param leaf not yet read: its shape and how to read any block of it."""

    shape: tuple[int, ...]
    read: Callable[[Index], np.ndarray]  # one slice per axis -> that block, on the host
    # Where set, the same block made on a device (None: the default one) from the tensors as
    # stored, and used instead of ``read``: see :mod:`jaxllm.loading.device_blocks`.
    put: Callable[[Index, Any], jax.Array] | None = None


def reads_int4(quantization: QuantizationConfig | None) -> bool:
    """Whether the projections are read packed from a 4-bit checkpoint."""
    return (quantization is not None and quantization.from_checkpoint
            and quantization.method in INT4_METHODS)


def reads_fp8(quantization: QuantizationConfig | None) -> bool:
    """Whether the projections are read as stored from an FP8 checkpoint: ``weight``
    e4m3 [out, in] (already the K-major layout of :class:`Fp8Weight`) and ``weight_scale``
    float [out, 1] (per channel) or [1] (per tensor)."""
    return (quantization is not None and quantization.from_checkpoint
            and quantization.method == "fp8")


def expected_hf_shapes(cfg: ModelConfig, quantization: QuantizationConfig | None = None
                       ) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape, for every tensor the model needs (a 4-bit
    checkpoint's projections: their packed tensors instead of ``weight``)."""
    h, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if reads_int4(quantization):
            for module, (k, n) in linear_in_out(cfg).items():
                del shapes[p + module + ".weight"]
                shapes |= tensor_shapes(p + module, k, n, quantization)
        if reads_fp8(quantization):
            for module, (_, n) in linear_in_out(cfg).items():
                per_channel = quantization.weight_strategy == "channel"
                shapes[p + module + ".weight_scale"] = (n, 1) if per_channel else (1,)
    return shapes


def qkv_columns(checkpoint: ModelConfig, config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """For each output column of the fused ``qkv_proj``: which projection it comes from (0 q,
    1 k, 2 v) and its row there. Columns are grouped by KV head of ``config`` (which may
    replicate the checkpoint's KV heads for tensor parallelism)."""
    d = config.head_dim
    group = config.num_attention_heads // config.num_key_value_heads
    repeat = config.num_key_value_heads // checkpoint.num_key_value_heads
    parts, rows = [], []
    for j in range(config.num_key_value_heads):
        source = j // repeat  # the checkpoint's KV head that head j copies
        parts += [0] * (group * d) + [1] * d + [2] * d
        rows += list(range(j * group * d, (j + 1) * group * d))
        rows += list(range(source * d, (source + 1) * d)) * 2
    return np.asarray(parts), np.asarray(rows)


def replicate_kv_heads(params: Any, checkpoint: ModelConfig, config: ModelConfig) -> Any:
    """``qkv_proj`` columns laid out for ``config``'s replicated KV heads, copied from the
    ``checkpoint`` layout's columns."""
    if config.num_key_value_heads == checkpoint.num_key_value_heads:
        return params
    old_parts, old_rows = qkv_columns(checkpoint, checkpoint)
    old = {(int(p), int(r)): c for c, (p, r) in enumerate(zip(old_parts, old_rows, strict=True))}
    parts, rows = qkv_columns(checkpoint, config)
    index = jnp.asarray([old[int(p), int(r)] for p, r in zip(parts, rows, strict=True)])

    def expand(path, leaf):
        names = path_names(path)
        if "qkv_proj" not in names:
            return leaf
        # Fp8Weight's qt is the kernel transposed, [.., N, K]: its columns are rows.
        return jnp.take(leaf, index, axis=-2 if names[-1] == "qt" else -1)

    return jax.tree_util.tree_map_with_path(expand, params)


def gate_up_columns(intermediate_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``gate_up_proj``'s columns: (gate_i, up_i) pairs."""
    return np.tile([0, 1], intermediate_size), np.repeat(np.arange(intermediate_size), 2)


def fill_fused(block: np.ndarray, columns: tuple[np.ndarray, np.ndarray], outs: np.ndarray,
               sources: list, read: Callable[[Any, np.ndarray], np.ndarray], *,
               axis: int = -1) -> np.ndarray:
    """Fills ``block``'s fused outputs ``outs`` (along ``axis``) from their sources: each
    ``columns`` part reads only its own rows, ``read(source, rows)``, outputs along ``axis``."""
    parts, rows = columns
    for part, source in enumerate(sources):
        mask = parts[outs] == part
        if mask.any():
            np.moveaxis(block, axis, 0)[mask] = np.moveaxis(read(source, rows[outs[mask]]),
                                                            axis, 0)
    return block


def hf_leaves(checkpoint: ModelConfig, config: ModelConfig, get: GetTensor,
              available: set[str], dtype: Any, source: str, *, unroll_layers: bool,
              quantization: QuantizationConfig | None = None) -> Any:
    """The param tree as :class:`Leaf` objects (per-layer trees when ``unroll_layers``, else
    leaves stacked on a layer axis). ``checkpoint`` is the config the tensors were saved with,
    ``config`` the one the model runs (they differ in KV heads when tensor parallelism
    replicates them). A 4-bit checkpoint's projections become :class:`Int4Weight` trees of
    leaves. Raises ModelLoadError naming a missing tensor."""
    expected = expected_hf_shapes(checkpoint, quantization)
    missing = sorted(set(expected) - available, key=_natural_key)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelLoadError(f"{source}: missing tensors {missing[:3]}{more}")

    # q, k, v of one layer (4 tensors each when quantized): read once for all their columns
    @functools.lru_cache(maxsize=16)
    def load(name: str) -> np.ndarray:
        array = get(name)
        if tuple(array.shape) != expected[name]:
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {tuple(array.shape)} but the config "
                f"expects {expected[name]}")
        return array

    def cast(array: np.ndarray) -> np.ndarray:
        return np.asarray(array).astype(dtype, copy=False)

    def whole(name: str) -> Leaf:
        return Leaf(expected[name], lambda idx: cast(load(name)[idx]),
                    lambda idx, device: on_device([load(name)[idx]], None, device, dtype, False))

    def transposed(name: str) -> Leaf:  # [out, in] -> [in, out]
        out, inp = expected[name]
        return Leaf((inp, out), lambda idx: cast(load(name)[idx[1], idx[0]].T),
                    lambda idx, device: on_device([load(name)[idx[1], idx[0]]], None, device,
                                                  dtype, True))

    def fused(names: list[str], columns: tuple[np.ndarray, np.ndarray], bias: bool) -> Leaf:
        parts = columns[0]
        inp = None if bias else expected[names[0]][1]

        def read(idx: Index) -> np.ndarray:
            cols = np.arange(len(parts))[idx[-1]]
            width = 0 if bias else len(range(inp)[idx[0]])
            block = np.empty((len(cols),) if bias else (width, len(cols)), dtype)
            return fill_fused(block, columns, cols, names, lambda name, r: cast(
                load(name)[r] if bias else load(name)[r][:, idx[0]].T))

        def put(idx: Index, device: Any) -> jax.Array:
            return fused_block(load, names, columns, idx, device, dtype, bias=bias)

        return Leaf((len(parts),) if bias else (inp, len(parts)), read, put)

    def int4(prefixes: list[str], columns: tuple[np.ndarray, np.ndarray]) -> Int4Weight:
        """The fused kernel of ``prefixes`` as packed words, scales and zero points, each
        read in blocks like ``fused`` (the words' rows are K / 8, the others' G)."""
        parts = columns[0]
        k = linear_in_out(checkpoint)[prefixes[0].split(".", 3)[-1]][0]
        sources = [Int4Linear(p, k, quantization, load) for p in prefixes]

        def leaf(height: int, read_part: Callable, out_dtype: Any) -> Leaf:
            def read(idx: Index) -> np.ndarray:
                block_rows, cols = range(height)[idx[0]], np.arange(len(parts))[idx[1]]
                block = np.empty((len(block_rows), len(cols)), out_dtype)
                return fill_fused(block, columns, cols, sources,
                                  lambda source, r: read_part(source, block_rows, r))

            return Leaf((height, len(parts)), read)

        groups = k // group_size(quantization, k)
        return Int4Weight(qweight=leaf(k // PER_WORD, Int4Linear.packed, np.int32),
                          scales=leaf(groups, Int4Linear.scales, dtype),
                          zeros=leaf(groups, Int4Linear.zeros, np.uint8))

    def fp8(prefixes: list[str], columns: tuple[np.ndarray, np.ndarray]) -> Fp8Weight:
        """The fused kernel of ``prefixes`` as stored: e4m3 rows [out, in] (Fp8Weight's
        K-major ``qt``) and one float32 scale per output (a per-tensor scale repeated)."""
        parts = columns[0]
        inp = expected[prefixes[0] + ".weight"][1]

        def read_qt(idx: Index) -> np.ndarray:  # outputs on axis 0: [out, in]
            outs, ins = np.arange(len(parts))[idx[0]], range(inp)[idx[1]]
            block = np.empty((len(outs), len(ins)), FP8_DTYPE)
            return fill_fused(block, columns, outs, prefixes, lambda p, r: load(
                p + ".weight")[r][:, ins.start:ins.stop:ins.step], axis=0)

        def read_scale(idx: Index) -> np.ndarray:
            outs = np.arange(len(parts))[idx[0]]
            per_tensor = quantization.weight_strategy == "tensor"
            return fill_fused(np.empty(len(outs), np.float32), columns, outs, prefixes,
                              lambda p, r: np.asarray(load(p + ".weight_scale"), np.float32)
                              .reshape(-1)[np.zeros_like(r) if per_tensor else r])

        return Fp8Weight(qt=Leaf((len(parts), inp), read_qt),
                         scale=Leaf((len(parts),), read_scale))

    def kernel(prefixes: list[str], columns: tuple[np.ndarray, np.ndarray] | None):
        """A projection's kernel [in, out]; ``columns`` None: one source, not fused."""
        if reads_fp8(quantization):
            if columns is None:
                n = expected[prefixes[0] + ".weight"][0]
                columns = (np.zeros(n, np.int64), np.arange(n))
            return fp8(prefixes, columns)
        if reads_int4(quantization):
            if columns is None:
                n = expected[prefixes[0] + ".scales"][1]
                columns = (np.zeros(n, np.int64), np.arange(n))
            return int4(prefixes, columns)
        if columns is None:
            return transposed(prefixes[0] + ".weight")
        return fused([p + ".weight" for p in prefixes], columns, False)

    qkv = qkv_columns(checkpoint, config)
    gate_up = gate_up_columns(config.intermediate_size)

    def layer(i: int) -> dict:
        p = f"model.layers.{i}."
        names = [p + f"self_attn.{x}_proj" for x in "qkv"]
        attn = {"qkv_proj": {"kernel": kernel(names, qkv)},
                "o_proj": {"kernel": kernel([p + "self_attn.o_proj"], None)}}
        if checkpoint.attention_bias:
            attn["qkv_proj"]["bias"] = fused([n + ".bias" for n in names], qkv, True)
        return {
            "input_layernorm": {"scale": whole(p + "input_layernorm.weight")},
            "post_attention_layernorm": {"scale": whole(p + "post_attention_layernorm.weight")},
            "attn": attn,
            "mlp": {
                "gate_up_proj": {"kernel": kernel([p + "mlp.gate_proj", p + "mlp.up_proj"],
                                                  gate_up)},
                "down_proj": {"kernel": kernel([p + "mlp.down_proj"], None)},
            },
        }

    layers = tuple(layer(i) for i in range(checkpoint.num_hidden_layers))
    params = {
        "embed_tokens": {"embedding": whole("model.embed_tokens.weight")},
        "layers": layers if unroll_layers else jax.tree.map(_stacked, *layers),
        "norm": {"scale": whole("model.norm.weight")},
    }
    if not checkpoint.tie_word_embeddings:
        params["lm_head"] = {"kernel": transposed("lm_head.weight")}
    return params


@dataclasses.dataclass(frozen=True)
class StackedLeaf(Leaf):
    """A leaf stacked on a leading layer axis from per-layer leaves: made on the device(s) one
    layer at a time, so the host never holds more than one layer's block."""

    layers: tuple[Leaf, ...] = ()


def _stacked(*layers: Leaf) -> StackedLeaf:
    def read(idx: Index) -> np.ndarray:
        return np.stack([layers[i].read(idx[1:]) for i in range(len(layers))[idx[0]]])

    return StackedLeaf((len(layers), *layers[0].shape), read, layers=layers)


def _put_staged(leaf: StackedLeaf, sharding: NamedSharding) -> jax.Array:
    """A stacked leaf split over pipeline stages: each stage's layers stacked on its own
    devices alone, one layer at a time (stacking on the whole mesh would hold every layer on
    every stage's devices, a whole 70B leaf per device), then joined as the stages' shards."""
    mesh, inner_spec = sharding.mesh, tuple(sharding.spec)[1:]
    stages = mesh.shape[PP_AXIS]
    per_stage = len(leaf.layers) // stages
    axis = mesh.axis_names.index(PP_AXIS)
    shards = []
    for stage in range(stages):
        devices = np.take(mesh.devices, [stage], axis=axis)  # the stage's slice, pp size 1
        if all(d.process_index != jax.process_index() for d in devices.flat):
            continue  # a stage on another host (multi-process): that process makes it
        sub = Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)
        layers = leaf.layers[stage * per_stage:(stage + 1) * per_stage]
        stacked = _put(_stacked(*layers), NamedSharding(sub, PartitionSpec(None, *inner_spec)))
        shards += [shard.data for shard in stacked.addressable_shards]
    return jax.make_array_from_single_device_arrays(leaf.shape, sharding, shards)


def _put(leaf: Leaf, sharding: NamedSharding | None) -> jax.Array:
    if isinstance(leaf, StackedLeaf):
        if sharding is not None and tuple(sharding.spec)[:1] == (PP_AXIS,):
            return _put_staged(leaf, sharding)
        inner = None if sharding is None else NamedSharding(
            sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
        parts = [_put(layer, inner) for layer in leaf.layers]
        stack = jax.jit(lambda *xs: jnp.stack(xs),
                        **({} if sharding is None else {"out_shardings": sharding}))
        stacked = stack(*parts)
        for part in parts:
            part.delete()
        return stacked
    if sharding is None:
        everything = tuple(slice(None) for _ in leaf.shape)
        return jnp.asarray(leaf.read(everything)) if leaf.put is None else \
            leaf.put(everything, None)
    if leaf.put is None:
        return jax.make_array_from_callback(leaf.shape, sharding, leaf.read)
    blocks = [leaf.put(idx, device)
              for device, idx in sharding.addressable_devices_indices_map(leaf.shape).items()]
    return jax.make_array_from_single_device_arrays(leaf.shape, sharding, blocks)


def materialize(leaves: Any, dtype: Any, shardings: Callable[[Any], Any] | None,
                transform: Callable[[tuple, jax.Array], Any] | None = None) -> Any:
    """Device arrays for a tree of :class:`Leaf`, one leaf (and layer) at a time.
    ``shardings`` maps the tree's ShapeDtypeStructs to NamedShardings
    (:func:`jaxllm.parallel.param_shardings`): each device then reads only its own block.
    ``transform(path, array)`` runs on each leaf as soon as it is made (load-time
    quantization), before the next is read."""
    is_leaf = lambda x: isinstance(x, Leaf)  # noqa: E731
    specs = None if shardings is None else shardings(
        jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, dtype), leaves,
                     is_leaf=is_leaf))
    specs = jax.tree.map(lambda _: None, leaves, is_leaf=is_leaf) if specs is None else specs

    def make(path, leaf, sharding):
        array = _put(leaf, sharding)
        return array if transform is None else transform(path, array)

    return jax.tree_util.tree_map_with_path(make, leaves, specs, is_leaf=is_leaf)


def assemble_params(checkpoint: ModelConfig, get: GetTensor, available: set[str], dtype: Any,
                    source: str, *, config: ModelConfig | None = None,
                    unroll_layers: bool = False,
                    shardings: Callable[[Any], Any] | None = None,
                    transform: Callable[[tuple, jax.Array], Any] | None = None,
                    quantization: QuantizationConfig | None = None) -> Any:
    """The param tree on the device(s), in ``dtype``; raises ModelLoadError naming any bad
    tensor. See :func:`hf_leaves` and :func:`materialize`."""
    leaves = hf_leaves(checkpoint, config or checkpoint, get, available, jnp.dtype(dtype),
                       source, unroll_layers=unroll_layers, quantization=quantization)
    return materialize(leaves, dtype, shardings, transform)


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in name.split(".")]
