"""jaxllm: LLM inference and serving in JAX over a paged KV cache.

Public API:
- :func:`load_model` - Hugging Face directories, GGUF files, dummy weights, or the embedded
  default model (SmolLM2-135M-Instruct).
- :func:`generate` - jit-compatible batched generation for research code.
- :func:`make_forward` - the pure model forward ``(params, kv_pool, batch) -> (logits, kv_pool)``.
- :class:`LLM` - offline batched generation and chat over the continuous-batching engine
  (:class:`LLMEngine`, :class:`AsyncLLMEngine` for servers), with :class:`SamplingParams`.
"""

import os as _os

# `jaxllm.serve`, `jaxllm.benchmarks` and `jaxllm.pallas_kernels` keep their folders at the top
# of the repository; a wheel installs them inside this package (pyproject's package-dir). Run
# from the source tree (`PYTHONPATH=.`, an editable install), the repository root joins this
# package's search path so that the same import names find them there.
_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_ROOT, "pyproject.toml")) and _os.path.isdir(
        _os.path.join(_ROOT, "serve")):
    __path__.append(_ROOT)

from jaxllm.batch import BatchMetadata, SeqChunk, SeqChunks, pack_batch
from jaxllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from jaxllm.engine.engine_config import EngineConfig
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from jaxllm.engine.sequence import SequenceStatus
from jaxllm.errors import JaxLLMError, ModelLoadError, UnsupportedModelError
from jaxllm.generate import GenerateOutput, generate
from jaxllm.kv_pool import KVPool, LayeredKVPool, new_kv_pool
from jaxllm.llm import LLM
from jaxllm.loading import LoadedModel, default_model_path, load_model
from jaxllm.model_config import ModelConfig, RopeScaling
from jaxllm.models import make_forward
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "AsyncLLMEngine", "CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
    "EngineConfig", "EngineDeadError", "LLMEngine", "PoolingParams", "RequestOutput",
    "RequestOutputKind", "SamplingParams", "SequenceStatus",
    "BatchMetadata", "GenerateOutput", "JaxLLMError", "KVPool", "LayeredKVPool", "LoadedModel",
    "ModelConfig", "ModelLoadError", "RopeScaling", "SeqChunk", "SeqChunks",
    "UnsupportedModelError", "__version__", "default_model_path", "generate", "load_model",
    "make_forward", "new_kv_pool", "pack_batch",
]
