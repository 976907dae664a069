"""Engine configuration: the flags of ``jaxllm serve`` / ``LLM(...)`` in one frozen dataclass.

Names and defaults follow vLLM where the meaning matches (``--max-num-seqs``,
``--max-num-batched-tokens``, ``--gpu-memory-utilization`` ...).
"""

from __future__ import annotations

import dataclasses
import logging
import os

SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = (None, "recompute", "swap")
BLOCK_SIZES = (8, 16, 32, 64, 128)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # --kv-cache-dtype: jaxllm.kv_pool.kv_cache_dtype
HASH_ALGOS = ("builtin", "sha256")
logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine limits and memory settings. ``None`` fields are filled in by the engine
    (from the model config and the device) and then frozen again."""

    model: str | None = None  # HF dir, .gguf file or config.json (dummy); None = default model
    # A tokenizer replacing the model's (HF dir, tokenizer.json or .gguf; vLLM's --tokenizer).
    tokenizer: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_num_seqs: int | None = None  # default: resolve_limits (1024 / 256 on GPU, 32 on CPU)
    max_num_batched_tokens: int | None = None  # default: resolve_limits (16384 .. 512)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks
    cpu_kv_cache_space: float = 4.0  # GiB for the KV pool when running on CPU
    num_gpu_blocks_override: int | None = None
    enforce_eager: bool = False  # no warm-up, no XLA command buffers (debugging)
    enable_prefix_caching: bool = False
    prefix_caching_hash_algo: str = "builtin"
    scheduling_policy: str = "fcfs"
    preemption_mode: str | None = None  # None: recompute for single sequences, swap for n > 1
    compilation_cache_dir: str | None = os.path.join(
        os.path.expanduser("~"), ".cache", "jaxllm", "xla")
    attention_backend: str = "auto"
    # Schedule and launch step k+1 before step k's samples reach the host (hides host time).
    async_scheduling: bool = True
    # Compile the layer stack unrolled, over a per-layer KV pool and per-layer params, rather
    # than as a loop. On the H200 an unrolled decode step was 1.4-2.3x faster and its launch
    # did not block the host; with the per-layer pool an engine-sized pool needs no temporary
    # copy (RESULTS.md, issue 6). None: unrolled on GPU, scanned elsewhere (CPU compiles of the
    # unrolled stack are slow, and its launch cost matters only on accelerators).
    unroll_layers: bool | None = None
    disable_log_stats: bool = False
    # Shard the model over this many local devices (jaxllm.parallel): Megatron-style weights,
    # the KV pool split by KV head. 1: one device.
    tensor_parallel_size: int = 1
    # Split the layers into this many pipeline stages, each over its own tensor_parallel_size
    # devices (jaxllm.parallel.pipeline): devices used = tp x pp; the KV pool split by layer
    # with the stages. The layers must divide evenly.
    pipeline_parallel_size: int = 1
    # Quantize (or read a quantized checkpoint's) weights: jaxllm.quantization. None: as the
    # checkpoint is.
    quantization: str | None = None
    # The KV pool's dtype: "auto" (the model's) or "fp8" (float8_e4m3fn, scale 1, as vLLM's
    # uncalibrated fp8 cache: half the bytes, twice the blocks; jaxllm.kv_pool.kv_cache_dtype).
    kv_cache_dtype: str = "auto"
    # Multi-host (vLLM's --nnodes/--node-rank/--master-addr/--master-port): one model over the
    # devices of ``nnodes`` processes, one a host, joined by jax.distributed. Node rank 0 (the
    # leader) schedules and serves; the others replay its device launches
    # (jaxllm.engine.multihost). The JAX coordinator listens on master_addr:master_port, the
    # leader's step channel on master_port + 1.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of "
             f"{', '.join(KV_CACHE_DTYPES)}")
        need(self.block_size in BLOCK_SIZES,
             f"block_size={self.block_size} must be one of {BLOCK_SIZES}")
        need(self.max_num_seqs is None or self.max_num_seqs >= 1,
             f"max_num_seqs={self.max_num_seqs} must be >= 1")
        need(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        need(self.max_model_len is None or self.max_model_len >= 2,
             f"max_model_len={self.max_model_len} must be >= 2")
        need(0 < self.gpu_memory_utilization <= 1,
             f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        need(self.tensor_parallel_size >= 1,
             f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        need(self.pipeline_parallel_size >= 1,
             f"pipeline_parallel_size={self.pipeline_parallel_size} must be >= 1")
        need(self.swap_space >= 0, f"swap_space={self.swap_space} must be >= 0 GiB")
        need(self.cpu_kv_cache_space > 0,
             f"cpu_kv_cache_space={self.cpu_kv_cache_space} must be > 0 GiB")
        need(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 2,
             f"num_gpu_blocks_override={self.num_gpu_blocks_override} must be >= 2 "
             "(block 0 is reserved)")
        need(self.scheduling_policy in SCHEDULING_POLICIES,
             f"scheduling_policy={self.scheduling_policy!r} must be one of "
             f"{SCHEDULING_POLICIES}")
        need(self.preemption_mode in PREEMPTION_MODES,
             f"preemption_mode={self.preemption_mode!r} must be one of recompute, swap")
        need(self.nnodes >= 1, f"nnodes={self.nnodes} must be >= 1")
        need(0 <= self.node_rank < self.nnodes,
             f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        need(1 <= self.master_port <= 65534,
             f"master_port={self.master_port} must be in [1, 65534] (the leader's step "
             "channel takes master_port + 1)")
        need(self.nnodes == 1 or self.preemption_mode != "swap",
             "preemption_mode='swap' is not supported with nnodes > 1 (each node would need "
             "its shards' swap space); preempted requests are recomputed")
        need(self.prefix_caching_hash_algo in HASH_ALGOS,
             f"prefix_caching_hash_algo={self.prefix_caching_hash_algo!r} must be one of "
             f"{HASH_ALGOS}")

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


# Who builds the engine (vLLM's UsageContext): its default limits depend on it.
USAGE_CONTEXTS = ("engine", "llm_class", "api_server")
LARGE_GPU_BYTES = 70 << 30


def default_limits(platform: str, device_memory: float | None, device_name: str,
                   usage_context: str) -> tuple[int, int, str]:
    """(max_num_seqs, max_num_batched_tokens, why) when the flags leave them unset: vLLM's
    V1 defaults. A GPU of >= 70 GiB that is not an A100 (H100, H200) takes 1024 sequences
    and 8192 tokens a step for the API server, 16384 for the offline LLM class (which waits
    for the whole batch, so longer steps cost it no latency): on an H200, 1000 sharegpt-like
    prompts gave 9,414 output tok/s at 256/2048 and 10,709 at 1024/8192 (issue 17).
    Smaller GPUs and the bare engine keep 256/2048, the CPU 32/512."""
    if usage_context not in USAGE_CONTEXTS:
        raise ValueError(f"usage_context={usage_context!r} must be one of {USAGE_CONTEXTS}")
    if platform == "cpu":
        return 32, 512, "the CPU's defaults"
    gib = "unknown" if device_memory is None else f"{device_memory / (1 << 30):.1f} GiB"
    device = f"{device_name or platform} ({gib})"
    large = (device_memory is not None and device_memory >= LARGE_GPU_BYTES
             and "a100" not in device_name.lower())
    if large and usage_context != "engine":
        tokens = 16384 if usage_context == "llm_class" else 8192
        return 1024, tokens, f"the defaults for {device}, {usage_context}"
    return 256, 2048, f"the defaults for {device}, {usage_context}"


def resolve_limits(config: EngineConfig, model_len: int, platform: str,
                   device_memory: float | None = None, device_name: str = "",
                   usage_context: str = "engine") -> EngineConfig:
    """``config`` with its sequence and batch limits made concrete: the model's context length
    unless less is asked, and :func:`default_limits` for what is unset (an explicit flag
    always wins). ``device_memory``: the accelerator's total bytes (None: unknown)."""
    max_model_len = config.max_model_len or model_len
    if max_model_len > model_len:
        raise ValueError(f"User-specified max_model_len ({max_model_len}) is greater than "
                         f"the derived max_model_len ({model_len}) of the model")
    seqs, tokens, why = default_limits(platform, device_memory, device_name, usage_context)
    max_batched = config.max_num_batched_tokens or tokens
    max_num_seqs = config.max_num_seqs or min(seqs, max_batched)
    if max_batched < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({max_batched}) must be >= max_num_seqs "
                         f"({max_num_seqs})")
    unset = [name for name in ("max_num_seqs", "max_num_batched_tokens")
             if getattr(config, name) is None]
    logger.info("max_num_seqs %d, max_num_batched_tokens %d, max_model_len %d%s",
                max_num_seqs, max_batched, max_model_len,
                f" ({' and '.join(unset)}: {why})" if unset else "")
    return config.replace(max_model_len=max_model_len, max_num_batched_tokens=max_batched,
                          max_num_seqs=max_num_seqs)


def resolve_unroll_layers(setting: bool | None, platform: str) -> bool:
    """``unroll_layers`` for a JAX platform name: as set, else unrolled on GPU only (pipeline
    stages too: each unrolls its own layers)."""
    return platform == "gpu" if setting is None else setting


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs, resolved: every limit is a concrete number."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "fcfs"
    preemption_mode: str | None = None
