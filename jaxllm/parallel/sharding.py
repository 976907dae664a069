"""Where every array lives on the mesh: a partition-spec table keyed by param name, the KV
pool's spec, and the checks a tensor-parallel size must pass (before any weight is read).

Megatron-style split of the Llama family (the column orders of the fused projections in
:mod:`jaxllm.models.llama` make a contiguous split give each device whole heads):

    embed_tokens/embedding     [V, H]            vocabulary split (rows)
    attn/qkv_proj/kernel       [H, Hkv (G+2) D]  output split: each device its KV heads and
                                                 their G query heads
    attn/o_proj/kernel         [Hq D, H]         input split, all-reduce after
    mlp/gate_up_proj/kernel    [H, 2 F]          output split: (gate, up) pairs of F
    mlp/down_proj/kernel       [F, H]            input split, all-reduce after
    lm_head/kernel             [H, V]            vocabulary split (columns)
    norms                                        replicated

A quantized kernel's parts split as the kernel: Int8Weight's ``q`` as the kernel, Fp8Weight's
transposed ``qt`` [N, K] with the kernel's two axes swapped, their per-column ``scale`` as the
output axis; Int4Weight's packed words [K/8, N] and its per-group
scales and zeros [G, N] on both axes as the kernel (a group never straddles two devices:
:func:`jaxllm.quantization.int4_checkpoint.check_int4_layout`), except that one group over
all rows (G = 1) is replicated along the input axis.

Stacked layers add a leading layer axis, split over ``pp`` into pipeline stages (each stage's
devices hold its consecutive layers; unsplit at pp = 1); per-layer trees under pipeline stages
hold one layer of each stage, [pp, ...], split the same way. The KV pool [L, blocks, block_size,
Hkv, D] is split by layer with the stages and by KV head within a stage: every device holds its
heads' pages of every block of its layers, so one block table serves all devices and the block
manager never sees the mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm.model_config import ModelConfig
from jaxllm.parallel.mesh import PP_AXIS, TP_AXIS, pipeline_parallel_size

# (module, leaf) -> spec of the leaf's trailing axes; absent: replicated.
_PARAM_SPECS: dict[tuple[str, str], tuple[str | None, ...]] = {
    ("embed_tokens", "embedding"): (TP_AXIS, None),
    ("qkv_proj", "kernel"): (None, TP_AXIS),
    ("qkv_proj", "bias"): (TP_AXIS,),
    ("o_proj", "kernel"): (TP_AXIS, None),
    ("gate_up_proj", "kernel"): (None, TP_AXIS),
    ("down_proj", "kernel"): (TP_AXIS, None),
    ("lm_head", "kernel"): (None, TP_AXIS),
}
_VOCAB_SPLIT = {("embed_tokens", "embedding"), ("lm_head", "kernel")}
KV_HEAD_AXIS = 3  # of a pool array [L, blocks, block_size, Hkv, D]


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raises ValueError naming ``--tensor-parallel-size`` when ``size`` cannot shard
    ``config`` (the same rules as vLLM; the device count is
    :func:`jaxllm.parallel.mesh.check_device_count`'s)."""
    flag = f"--tensor-parallel-size {size}"
    if size < 1:
        raise ValueError(f"{flag}: must be >= 1")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise ValueError(
            f"{flag}: the model's {heads} attention heads must be divisible by the "
            f"tensor-parallel size (each device computes whole heads)")
    if size <= kv_heads and kv_heads % size:
        raise ValueError(
            f"{flag}: the model's {kv_heads} KV heads must be divisible by the "
            "tensor-parallel size")
    if size > kv_heads and size % kv_heads:
        raise ValueError(
            f"{flag}: larger than the model's {kv_heads} KV heads, so it must be a multiple of "
            "them (each KV head is replicated on size / KV heads devices)")
    if config.intermediate_size % size:
        raise ValueError(
            f"{flag}: the model's intermediate size {config.intermediate_size} must be "
            "divisible by the tensor-parallel size")


def check_pipeline_parallel(config: ModelConfig, size: int) -> None:
    """Raises ValueError naming ``--pipeline-parallel-size`` when ``size`` cannot split
    ``config``'s layers into equal stages. Equal stages, not vLLM's as-even-as-possible split:
    the stage loop is one SPMD program over equal shards of the stacked layers."""
    flag = f"--pipeline-parallel-size {size}"
    if size < 1:
        raise ValueError(f"{flag}: must be >= 1")
    layers = config.num_hidden_layers
    if layers % size:
        fits = [n for n in range(1, layers + 1) if layers % n == 0]
        raise ValueError(
            f"{flag}: the model's {layers} layers must be divisible by the pipeline-parallel "
            f"size (every stage runs the same number of layers); sizes that fit: "
            f"{', '.join(map(str, fits[:8]))}{' ...' if len(fits) > 8 else ''}")


def tensor_parallel_config(config: ModelConfig, size: int) -> ModelConfig:
    """``config`` as the sharded model sees it: with more devices than KV heads, every KV head
    is replicated ``size / Hkv`` times (as vLLM does) so that each device holds one. The
    loaders repeat the K/V projections to match (:func:`kv_head_source`); the pool holds one
    head per device."""
    check_tensor_parallel(config, size)
    if size <= config.num_key_value_heads:
        return config
    return dataclasses.replace(config, num_key_value_heads=size)


def kv_head_source(config: ModelConfig, checkpoint_kv_heads: int) -> list[int]:
    """For each KV head of ``config`` (possibly replicated), the checkpoint's head it copies."""
    repeat = config.num_key_value_heads // checkpoint_kv_heads
    return [head // repeat for head in range(config.num_key_value_heads)]


def path_names(path: tuple) -> list:
    """A pytree path's keys as names: dict keys, and the field names of a quantized kernel's
    parts (Int8Weight.q, Fp8Weight.qt, .scale, ...)."""
    return [getattr(k, "key", getattr(k, "name", None)) for k in path]


def param_spec(path: tuple, shape: tuple[int, ...], vocab_split: bool = True) -> PartitionSpec:
    """The table's spec of the param leaf at ``path`` (a quantized kernel's part included)."""
    names = path_names(path)
    part = None
    if len(names) >= 3 and names[-2] == "kernel":  # a quantized kernel's part (linear.py)
        names, part = names[:-1], names[-1]
    key = (names[-2], names[-1]) if len(names) >= 2 else (None, None)
    trailing = _PARAM_SPECS.get(key, ())
    if key in _VOCAB_SPLIT and not vocab_split:
        trailing = ()
    if part == "scale" and trailing:  # per output channel: split as the kernel's output axis
        trailing = trailing[-1:]
    if part == "qt" and trailing:  # the kernel transposed, [N, K]
        trailing = trailing[::-1]
    if part in ("scales", "zeros") and trailing and shape[-2] == 1:
        # An Int4Weight with one group over all input rows: every input shard uses that row.
        trailing = (None, trailing[-1])
    return PartitionSpec(*([None] * (len(shape) - len(trailing))), *trailing)


def _stage_split(path: tuple, spec: PartitionSpec) -> PartitionSpec:
    """``spec`` with a layer leaf's leading axis split over the stages: a stacked leaf's layer
    axis, or a stage-major per-layer leaf's stage axis [P, ...]
    (:func:`jaxllm.models.llama.unstack_layer_params`)."""
    if path_names(path)[0] != "layers":
        return spec
    return PartitionSpec(PP_AXIS, *tuple(spec)[1:])


def param_shardings(params: Any, mesh: Mesh, config: ModelConfig) -> Any:
    """A NamedSharding for every leaf of ``params`` (arrays or ShapeDtypeStructs, stacked or
    per-layer; pipeline stages need the stacked layout). A vocabulary the mesh cannot split
    evenly keeps the embedding and LM head replicated."""
    vocab_split = config.vocab_size % mesh.shape[TP_AXIS] == 0
    staged = pipeline_parallel_size(mesh) > 1

    def sharding(path, leaf):
        spec = param_spec(path, tuple(leaf.shape), vocab_split)
        return NamedSharding(mesh, _stage_split(path, spec) if staged else spec)

    return jax.tree_util.tree_map_with_path(sharding, params)


def kv_pool_shardings(pool: Any, mesh: Mesh) -> Any:
    """The pool (either layout) split by KV head, and the stacked pool by layer over the
    pipeline stages."""
    layer = PP_AXIS if pipeline_parallel_size(mesh) > 1 else None
    spec = PartitionSpec(layer, *([None] * (KV_HEAD_AXIS - 1)), TP_AXIS, None)
    return jax.tree.map(lambda _: NamedSharding(mesh, spec), pool)


def logits_sharding(mesh: Mesh, config: ModelConfig) -> NamedSharding:
    """Where the forward's logits [N, V] live: split by vocabulary, as the LM head computes
    them (the sampler runs on the shards; XLA gathers only what its reductions need)."""
    vocab_split = config.vocab_size % mesh.shape[TP_AXIS] == 0
    return NamedSharding(mesh, PartitionSpec(None, TP_AXIS if vocab_split else None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
