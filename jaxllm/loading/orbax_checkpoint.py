"""``jaxllm convert``'s checkpoints: a model's params as an orbax checkpoint, already in the
precision (float, int8, fp8) and layer layout the engine runs, with the config and tokenizer
beside them, so that loading it is a restore straight into device memory (in ~1 GiB groups,
under a progress bar), with no conversion on the host.

Directory layout::

    OUT/jaxllm_checkpoint.json   what was converted: config, dtype, quantization, layout
    OUT/params/                  the orbax (PyTreeCheckpointHandler) pytree of params
    OUT/tokenizer/               the tokenizer (save_pretrained), when the model has one

Loading never unpickles anything: the params' structure is rebuilt from the recorded config,
dtype, quantization and layout, and the restore checks every leaf's shape and dtype.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp

from jaxllm.errors import ModelLoadError
from jaxllm.loading.dummy import param_shapes
from jaxllm.model_config import ModelConfig, RopeScaling
from jaxllm.models.llama import unstack_layer_params
from jaxllm.quantization import QuantizationConfig, quantization_method
from jaxllm.quantization.apply import stand_in_shape
from jaxllm.quantization.config import IMPLEMENTED

METADATA_FILE = "jaxllm_checkpoint.json"
# 2: Fp8Weight stored transposed (``qt`` [.., N, K], the FP8 GEMM's layout); a format-1
# checkpoint of any precision is converted again.
FORMAT_VERSION = 2


def is_converted_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def save_converted(model: Any, out: str) -> None:
    """Writes ``model`` (a one-device :class:`~jaxllm.loading.LoadedModel`) to ``out``, which
    must not exist or be empty."""
    import orbax.checkpoint as ocp

    if model.mesh is not None:
        raise ValueError("convert writes one-device checkpoints: load the source with "
                         "tensor_parallel_size 1 (the converted checkpoint loads at any size)")
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"{out} exists and is not an empty directory: convert never "
                         "overwrites")
    os.makedirs(out, exist_ok=True)
    # Uncompressed: weights gain little from zstd (bf16 ~20%, random or quantized bits less)
    # and restoring decompresses every byte on the host, in the warm restart's critical path.
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    checkpointer.save(os.path.join(out, "params"), args=ocp.args.PyTreeSave(model.params))
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(os.path.join(out, "tokenizer"))
    metadata = {
        "format_version": FORMAT_VERSION, "name": model.name,
        "config": dataclasses.asdict(model.config), "dtype": jnp.dtype(model.dtype).name,
        "quantization": (dataclasses.asdict(model.quantization)
                         if model.quantization is not None else None),
        "unroll_layers": model.unroll_layers,
    }
    with open(os.path.join(out, METADATA_FILE), "w") as f:
        json.dump(metadata, f, indent=2)


# A restore's size: large enough for orbax's concurrent reads to keep the host busy, small
# enough for the progress bar to move (an 8B model: 15 groups).
RESTORE_GROUP_BYTES = 1 << 30


def leaf_bytes(x: Any) -> int:
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def restore_groups(leaves: list[Any], group_bytes: int) -> list[set[int]]:
    """Leaf indices in order, cut into groups of at least ``group_bytes`` (the last one may
    be smaller)."""
    groups, group, size = [], set(), 0
    for i, leaf in enumerate(leaves):
        group.add(i)
        size += leaf_bytes(leaf)
        if size >= group_bytes:
            groups.append(group)
            group, size = set(), 0
    return groups + [group] if group else groups


def _checked(array: Any, expected: Any, path: str) -> Any:
    if array is None or array.shape != expected.shape or array.dtype != expected.dtype:
        got = None if array is None else (array.shape, array.dtype)
        raise ModelLoadError(f"{path}: its params do not match its metadata (a leaf restored "
                             f"as {got}, expected {(expected.shape, expected.dtype)})")
    return array


@dataclasses.dataclass(frozen=True)
class ConvertedCheckpoint:
    """What a converted checkpoint holds, read from its metadata file."""

    path: str
    name: str
    config: ModelConfig
    dtype: Any
    quantization: QuantizationConfig | None
    unroll_layers: bool

    @classmethod
    def open(cls, path: str) -> ConvertedCheckpoint:
        try:
            with open(os.path.join(path, METADATA_FILE)) as f:
                meta = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{path}: cannot read {METADATA_FILE} ({e})") from None
        if meta.get("format_version") != FORMAT_VERSION:
            raise ModelLoadError(f"{path}: checkpoint format {meta.get('format_version')!r}; "
                                 f"this jaxllm reads format {FORMAT_VERSION}")
        config = dict(meta["config"])
        config["rope_scaling"] = RopeScaling(**config["rope_scaling"])
        config["eos_token_ids"] = tuple(config["eos_token_ids"])
        quantization = meta["quantization"]
        return cls(path, meta["name"], ModelConfig(**config), jnp.dtype(meta["dtype"]),
                   QuantizationConfig(**quantization | {
                       "modules_to_not_convert": tuple(
                           quantization.get("modules_to_not_convert", ()))})
                   if quantization else None,
                   bool(meta["unroll_layers"]))

    def check_request(self, dtype: Any | None, quantization: str | None) -> None:
        """A converted checkpoint loads as it was converted: another ``dtype`` (None: auto)
        or quantization is refused (convert again) rather than silently ignored."""
        if dtype is not None and jnp.dtype(dtype) != self.dtype:
            raise ValueError(f"{self.path} was converted with dtype {self.dtype.name}: load it "
                             f"with dtype auto, or convert again with --dtype "
                             f"{jnp.dtype(dtype).name}")
        method = self.quantization.method if self.quantization else None
        wanted = quantization_method(quantization)
        if quantization is not None and wanted != method:
            # convert quantizes float weights with the load-time methods only; a 4-bit model
            # comes from a checkpoint already in that format
            remedy = (f"convert again with --quantization {wanted}" if wanted in IMPLEMENTED
                      else f"convert a {wanted} checkpoint (convert keeps its quantization)")
            raise ValueError(f"{self.path} was converted with quantization {method}: load it "
                             f"without --quantization, or {remedy}")

    def abstract_params(self) -> Any:
        """The params' pytree of ShapeDtypeStructs (one device), as saved."""
        shapes = param_shapes(self.config, self.dtype)
        quantization = self.quantization

        def build(shapes):
            params = jax.tree_util.tree_map_with_path(
                lambda path, x: stand_in_shape(path, x, quantization), shapes)
            return unstack_layer_params(params) if self.unroll_layers else params

        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                            jax.eval_shape(build, shapes))

    def restore_params(self, progress: bool = True) -> Any:
        """The params on the device, restored in groups of about RESTORE_GROUP_BYTES (each
        group one concurrent orbax restore of its leaves) under a progress bar in GiB."""
        import orbax.checkpoint as ocp
        from tqdm.auto import tqdm

        abstract = self.abstract_params()
        leaves, treedef = jax.tree.flatten(abstract)
        restored: list[Any] = [None] * len(leaves)
        checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
        with tqdm(total=sum(leaf_bytes(x) for x in leaves) / 2**30, unit="GiB",
                  bar_format="{desc}: {percentage:3.0f}% {n:.1f}/{total:.1f} GiB "
                             "[{elapsed}<{remaining}]",
                  desc="Loading orbax checkpoint", disable=not progress) as bar:
            for group in restore_groups(leaves, RESTORE_GROUP_BYTES):
                # Leaves outside the group are placeholders: orbax skips them.
                target = jax.tree.unflatten(treedef, [
                    leaves[i] if i in group else ocp.PLACEHOLDER for i in range(len(leaves))])
                restore_args = jax.tree.map(
                    lambda x: x if x is ocp.PLACEHOLDER else ocp.ArrayRestoreArgs(
                        sharding=x.sharding, global_shape=x.shape, dtype=x.dtype), target)
                try:
                    out = checkpointer.restore(os.path.join(self.path, "params"),
                                               args=ocp.args.PyTreeRestore(
                                                   item=target, restore_args=restore_args))
                except (ValueError, KeyError, FileNotFoundError) as e:
                    raise ModelLoadError(f"{self.path}: its params do not match its metadata "
                                         f"({e})") from None
                out = jax.tree.leaves(out, is_leaf=lambda x: x is ocp.PLACEHOLDER)
                for i in group:
                    restored[i] = _checked(out[i], leaves[i], self.path)
                bar.update(sum(leaf_bytes(leaves[i]) for i in group) / 2**30)
        return jax.tree.unflatten(treedef, restored)

    def tokenizer(self) -> Any:
        from jaxllm.loading.tokenizer import load_hf_tokenizer

        path = os.path.join(self.path, "tokenizer")
        return load_hf_tokenizer(path) if os.path.isdir(path) else None

