"""Model runner: the only engine part that touches the device.

It owns the params, the KV pool (donated to every jitted step) and the host swap pool. Each
step it applies the scheduler's block moves, packs the scheduled tokens into one padded
:class:`BatchMetadata` (numpy, then one transfer), and launches ``forward`` and ``sample``
(compiled per shape bucket and per row bucket). Sampling results come back as numpy.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.batch import BatchMetadata, PackedBatch, pack_batch
from jaxllm.engine.buckets import BucketSpec, StepShape
from jaxllm.engine.executable_cache import compile_lowered
from jaxllm.engine.memory_errors import out_of_memory_explained
from jaxllm.engine.scheduler import SchedulerOutput
from jaxllm.engine.step_handles import (
    LaunchedForward,
    PendingStep,
    PreparedForward,
)
from jaxllm.engine.step_inputs import pack_step
from jaxllm.engine.step_programs import ProgramKey, stage_step_input, step_programs
from jaxllm.kv_pool import new_kv_pool
from jaxllm.loading import LoadedModel
from jaxllm.parallel import logits_sharding
from jaxllm.parallel.distributed import put_from_host
from jaxllm.quantization.compile_options import forward_compiler_options
from jaxllm.sampler_rows import (
    SamplerInput,
    SampleVariant,
    build_sampling_metadata,
    penalty_width,
    sample_variant,
)
from jaxllm.sampling import SamplingMetadata
from jaxllm.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)

BANNED_WIDTH = 8  # EOS + stop_token_ids banned below min_tokens; more ids are rare
# Compiled at warm-up for every row bucket: all greedy, plain random, random with top-k/top-p.
WARM_SAMPLER_VARIANTS = (SampleVariant(all_greedy=True, use_top_k_top_p=False),
                         SampleVariant(use_top_k_top_p=False), SampleVariant())
# ... and, when the model has a tokenizer (structured outputs possible), the same three with
# a grammar bitmask: compiled mid-run, each would stall the step loop for a compilation.
WARM_BITMASK_VARIANTS = tuple(v._replace(use_bitmask=True) for v in WARM_SAMPLER_VARIANTS)


def _runs_first_by_default() -> bool:
    """A GPU executable's first launch does first-time work (loading its kernels among it): on
    the H200 the first step of each bucket took 40-220 ms longer than the next ones (~1 s of
    a 16 s offline run, and the first requests' TTFT). A CPU program's costs nothing extra.
    Every node of a multi-host engine warms up alike: the launches stay in step."""
    return jax.devices()[0].platform != "cpu"


def _pad_to_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class ModelRunner:
    def __init__(self, model: LoadedModel, *, block_size: int, num_gpu_blocks: int,
                 num_cpu_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, attention_backend: str = "auto",
                 bucket_table_width: bool = True, kv_dtype=None, executable_cache=None):
        self.model = model
        self.config = model.config
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.buckets = BucketSpec.build(max_num_seqs, max_num_batched_tokens,
                                        self.max_blocks_per_seq, bucket_table_width)
        cfg = self.config
        mesh = model.mesh  # tensor parallel: the pool is split by KV head over it

        # The pool's layout follows the params' (scanned or unrolled layer stack).
        kv_dtype = kv_dtype or model.dtype  # --kv-cache-dtype
        self._new_pool = lambda: new_kv_pool(cfg, num_gpu_blocks, block_size, kv_dtype,
                                             unroll_layers=model.unroll_layers, mesh=mesh)
        # Waited for: dispatch is asynchronous, and an allocation that fails must fail here.
        self.kv_pool = jax.block_until_ready(self._new_pool())
        self._logits_sharding = None if mesh is None else logits_sharding(mesh, cfg)
        # Executables are compiled against the pool's shapes, also while warm-up frees it.
        self._pool_spec = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.kv_pool)
        # The swap pool, allocated now as vLLM does (untouched pages cost no host memory), so
        # that a host that cannot hold it says so at start-up rather than at the first swap.
        with out_of_memory_explained("allocating the host swap space"):
            shape = (self.kv_pool.num_layers, num_cpu_blocks, *self.kv_pool.block_shape)
            self._host_k = np.zeros(shape, self.kv_pool.dtype) if num_cpu_blocks else None
            self._host_v = np.zeros(shape, self.kv_pool.dtype) if num_cpu_blocks else None
        self.max_rows = self.buckets.batch_sizes[-1]
        # Forward and sampler are compiled separately: the sampler's shape depends only on
        # the row count, so it compiles once per batch bucket instead of once per step shape.
        program_key = ProgramKey(cfg, model.dtype, attention_backend, mesh, self.max_rows,
                                 stage_step_input())
        self._programs = step_programs(program_key)
        # Warm restarts: compiled programs read from disk without tracing (ExecutableCache);
        # the context is what shapes them besides their arguments.
        self.executable_cache = executable_cache
        # FP8 forwards compile with a cheaper GEMM autotuning (compile_options.py says why).
        self._forward_options = forward_compiler_options(model.quantization)
        self._program_context = (program_key, model.unroll_layers, repr(model.quantization),
                                 sorted(self._forward_options.items()))
        self._no_prev_tokens = jnp.zeros((self.max_rows,), jnp.int32)
        self._forward_exe: dict[tuple[StepShape, bool], tuple] = {}  # -> (exe, shardings)
        self._sample_exe: dict[tuple, object] = {}
        self.num_compilations = 0  # executables built (warm-up included)
        # warm_up's programs, those found in the executable cache, and each phase's seconds.
        self.warm_up_report: dict | None = None
        # Largest temporary device memory of any compiled forward or sampler (XLA's plan): the
        # step's transient peak on top of weights and pool.
        self.max_step_temp_bytes = 0
        self._compile_lock = threading.Lock()
        self._warming_up = False  # its threads compile at once: traces dropped after them
        self.num_steps = 0  # samplers launched
        self.num_forwards = 0
        # Multi-host leader: sends each device launch, before it is made, to the workers,
        # which launch the same (jaxllm.engine.multihost.StepBroadcaster). None: one process.
        self.mirror = None
        self._put = jax.device_put if jax.process_count() == 1 else put_from_host

    # ------------------------------------------------------------------ warm-up
    def warm_up(self, progress: bool = True, workers: int | None = None,
                first_runs: bool | None = None) -> float:
        """Compiles every step bucket and sampler size ahead of time (compilation runs in
        parallel threads: XLA releases the GIL), then with ``first_runs`` (default: on
        accelerators) launches each once; returns the seconds spent."""
        from concurrent.futures import ThreadPoolExecutor

        from tqdm.auto import tqdm

        workers = workers or max(4, min(16, os.cpu_count() or 1))
        start = time.perf_counter()
        jobs = [(self._forward_executable, shape) for shape in self.buckets.all_shapes()]
        jobs += [(self._sampler_executable, (rows, 0, variant))
                 for rows in sorted({s.num_seqs for s in self.buckets.all_shapes()})
                 for variant in WARM_SAMPLER_VARIANTS + (
                     WARM_BITMASK_VARIANTS if self.model.tokenizer is not None else ())]
        # Programs in the executable cache are loaded first, then the rest compiled: the
        # start-up log gives each phase's time (warm_up_report).
        cached = [] if self.executable_cache is None else [
            job for job in jobs if self.executable_cache.contains(self._cache_key(*job))]
        jobs = cached + [job for job in jobs if job not in cached]
        # The pool is released while compiling: XLA's GEMM autotuner allocates operand-sized
        # scratch buffers (a stacked weight is GBs), one set per compiling thread. Kept when
        # every program loads from the executable cache: a new pool costs its zeroing again
        # (the ready line's "KV cache" phase: 5 s of SmolLM2's 25 s warm-up on CPU).
        release = len(cached) < len(jobs)
        if release:
            jax.tree.map(lambda x: x.delete(), self.kv_pool)
            self.kv_pool = None
        self._warming_up = True
        try:
            with ThreadPoolExecutor(workers) as pool, tqdm(
                    total=len(jobs), desc="Compiling step buckets", disable=not progress,
                    unit="graph") as bar:
                loaded_at = start
                for done, _ in enumerate(pool.map(lambda job: job[0](job[1]), jobs), 1):
                    bar.update(1)
                    if done == len(cached):
                        loaded_at = time.perf_counter()
        finally:
            self._warming_up = False
        self._drop_traces()
        self.warm_up_report = {"programs": len(jobs), "cached": len(cached),
                               "load_seconds": loaded_at - start,
                               "compile_seconds": time.perf_counter() - loaded_at}
        if release:
            self.kv_pool = self._new_pool()
        for size in sorted({_pad_to_power_of_two(s) for s in self.buckets.batch_sizes}):
            ids = np.zeros((size,), np.int32)  # block moves are padded as copy_blocks pads them
            self.kv_pool = self._programs.copy(self.kv_pool, ids, ids)
        run_at = time.perf_counter()
        if _runs_first_by_default() if first_runs is None else first_runs:
            self._run_each_program_once(jobs)
        jax.block_until_ready(self.kv_pool)
        self.warm_up_report["first_run_seconds"] = time.perf_counter() - run_at
        return time.perf_counter() - start

    def _run_each_program_once(self, jobs: list) -> None:
        """Launches every warm-up program once on an empty batch (its padded tokens write
        nothing: the pool is unchanged), as a step would, so that no step pays a program's
        first run."""
        samplers = {key for build, key in jobs if build == self._sampler_executable}
        results = []
        for shape in self.buckets.all_shapes():
            prepared = self.prepare_packed(shape, False, self._empty_metadata(shape), None)
            launched = self.launch_forward(prepared)
            for key in sorted((k for k in samplers if k[0] == shape.num_seqs), key=repr):
                samplers.discard(key)
                md = self._sampler_inputs(key)[2][1]
                results.append(self.launch_sampler_packed(launched, key, md).tokens)
        jax.block_until_ready(results)
        self.num_forwards = self.num_steps = 0  # counted from the first real step

    def _drop_traces(self) -> None:
        """Drops JAX's traces (jaxprs) of the compiled step programs, never lowered twice:
        unrolled, millions of objects (SmolLM2: 5.7 M tracked after warm-up, 0.55 M without)
        that a full collection walks, 1.3 s of an offline H200 run (RESULTS.md, 2026-12-06).
        ``clear_cache`` also empties JAX's shared cache of traced signatures."""
        for program in (self._programs.forward, self._programs.sample):
            program.clear_cache()

    def _count_compilation(self, exe) -> None:
        temp = int(getattr(exe.memory_analysis(), "temp_size_in_bytes", 0) or 0)
        with self._compile_lock:  # warm-up compiles from several threads
            self.num_compilations += 1
            self.max_step_temp_bytes = max(self.max_step_temp_bytes, temp)

    def _forward_executable(self, shape: StepShape, pooling: bool = False):
        """The compiled forward of a step shape, and where its packed batch lives (the
        sharding ``prepare_forward`` transfers it with)."""
        entry = self._forward_exe.get((shape, pooling))
        if entry is None:
            if self.mirror is not None:  # the workers compile it now, not after the launch
                self.mirror.send(("compile", "forward", (shape, pooling)))
            exe = self._compile(*self._forward_inputs(shape, pooling))
            args = exe.input_shardings[0]  # (params, pool, packed batch, prev_tokens)
            entry = self._forward_exe[shape, pooling] = (exe, args[2])
            self._count_compilation(exe)
            if pooling and self.num_steps:
                logger.info("compiled the pooling forward for %s", shape)
            if not self._warming_up:
                self._drop_traces()
        return entry

    def _sampler_executable(self, key: tuple[int, int, SampleVariant]):
        exe = self._sample_exe.get(key)
        if exe is None:
            if self.mirror is not None:  # the workers compile it now, not after the launch
                self.mirror.send(("compile", "sampler", (key,)))
            exe = self._sample_exe[key] = self._compile(*self._sampler_inputs(key))
            rows, width, variant = key
            self._count_compilation(exe)
            if self.num_steps:
                logger.info("compiled sampler variant rows=%d penalty_width=%d %s", rows,
                            width, variant)
            if not self._warming_up:
                self._drop_traces()
        return exe

    def _forward_inputs(self, shape: StepShape, pooling: bool = False):
        batch = self._empty_batch(shape)
        return ("forward", self._programs.forward, (self.model.params, self._pool_spec, batch,
                self._no_prev_tokens), {"pooling": pooling}, self._forward_options)

    def _sampler_inputs(self, key: tuple[int, int, SampleVariant]):
        rows, width, variant = key
        vocab = self.config.vocab_size
        logits = jax.ShapeDtypeStruct((rows, vocab), jnp.float32,
                                      sharding=self._logits_sharding)
        bitmask = np.zeros((rows, -(-vocab // 32)), np.int32) if variant.use_bitmask else None
        md = build_sampling_metadata([], rows, width, BANNED_WIDTH, bitmask)
        return "sample", self._programs.sample, (logits, md), variant._asdict()

    def _compile(self, name: str, jitted, args: tuple, static: dict,
                 compiler_options: dict | None = None):
        """``jitted`` lowered and compiled for ``args``, or read from the executable cache."""
        if self.executable_cache is None:
            return compile_lowered(jitted.lower(*args, **static), compiler_options)
        return self.executable_cache.get_or_compile(name, jitted, args, static,
                                                    self._program_context, compiler_options)

    def _cache_key(self, build, arg) -> str:
        name, _, args, static, *_ = (self._forward_inputs(arg)
                                     if build == self._forward_executable
                                     else self._sampler_inputs(arg))
        return self.executable_cache.key(name, args, static, self._program_context)

    def _empty_metadata(self, shape: StepShape) -> BatchMetadata:
        return pack_batch([], self.block_size, num_tokens=shape.num_tokens,
                          num_seqs=shape.num_seqs, table_width=shape.table_width,
                          num_logits=shape.num_seqs, decode_only=shape.is_decode)

    def _empty_batch(self, shape: StepShape) -> PackedBatch:
        return PackedBatch.pack(self._empty_metadata(shape),
                                np.full(shape.num_tokens, -1, np.int32))

    # --------------------------------------------------------------------- step
    def prepare_forward(self, out: SchedulerOutput, pooling: bool = False) -> PreparedForward:
        """Everything of a step's forward before its launch: block moves, packing, and the
        inputs' transfer to the device (JAX dispatch is asynchronous: nothing here waits for
        the device). Apart from the launch so that it can run while the previous step's
        sampler still waits for its grammar bitmask. ``pooling``: the step also returns
        pooled hidden states (``StepResult.pooled_*``)."""
        self._apply_block_moves(out)
        batch, shape, prev_rows = self.pack(out)
        return self.prepare_packed(shape, pooling, batch, prev_rows)

    def prepare_packed(self, shape: StepShape, pooling: bool, batch: BatchMetadata,
                       prev_rows: np.ndarray | None) -> PreparedForward:
        """``prepare_forward`` from a packed batch (``pack``'s numpy values): where a
        multi-host worker starts, from the leader's arrays."""
        host = (shape, pooling, batch, prev_rows) if self.mirror is not None else None
        has_placeholders = prev_rows is not None
        if prev_rows is None:
            prev_rows = np.full(shape.num_tokens, -1, np.int32)
        exe, sharding = self._forward_executable(shape, pooling)
        packed = self._put(PackedBatch.pack(batch, prev_rows), sharding)
        return PreparedForward(exe, packed, has_placeholders, shape, host)

    def launch_forward(self, prepared: PreparedForward,
                       prev: PendingStep | None = None) -> LaunchedForward:
        """Launches a prepared forward; its placeholder tokens (``Sequence.pending``) come from
        ``prev``'s samples on the device.
        The sampler is launched apart (``launch_sampler``) when its inputs need the host to
        see ``prev``'s tokens first (the grammar bitmask of constrained rows)."""
        if prepared.has_placeholders and prev is None:
            raise ValueError("placeholder tokens need the step that samples them")
        if self.mirror is not None:
            self.mirror.send(("forward", self.num_forwards, prepared.host,
                              prev.index if prepared.has_placeholders else -1))
        prev_tokens = prev.tokens if prepared.has_placeholders else self._no_prev_tokens
        logits, self.kv_pool, pooled = prepared.executable(
            self.model.params, self.kv_pool, prepared.batch, prev_tokens)
        self.num_forwards += 1
        return LaunchedForward(logits, prepared.shape, pooled, self.num_forwards - 1)

    def launch_sampler(self, launched: LaunchedForward, rows: Sequence[SamplerInput],
                       token_bitmask: np.ndarray | None = None) -> PendingStep:
        """The second half of ``dispatch``: samples the forward's logits. ``token_bitmask``
        (i32[rows bucket, W]) is required when a row is constrained."""
        shape = launched.shape
        variant = sample_variant(rows)
        # Logprob counts round up to the maximum: one variant instead of twenty.
        variant = variant._replace(num_logprobs=MAX_LOGPROBS if variant.num_logprobs else 0)
        if variant.use_bitmask and token_bitmask is None:
            raise ValueError("constrained rows need a token bitmask")
        md = build_sampling_metadata(
            rows, shape.num_seqs,
            _pad_to_power_of_two(penalty_width(rows)) if variant.use_penalties else 0,
            BANNED_WIDTH, token_bitmask if variant.use_bitmask else None)
        return self.launch_sampler_packed(launched, (shape.num_seqs, md.token_ids.shape[1],
                                                     variant), md)

    def launch_sampler_packed(self, launched: LaunchedForward, key: tuple,
                              md: SamplingMetadata) -> PendingStep:
        """``launch_sampler`` from its metadata (numpy) and sampler key (rows, penalty width,
        variant): where a multi-host worker starts, from the leader's."""
        if self.mirror is not None:
            self.mirror.send(("sample", launched.index, key, md))
        result, tokens = self._sampler_executable(key)(launched.logits, md)
        self.num_steps += 1
        return PendingStep(result, tokens, launched.shape, launched.pooled, self.num_steps - 1)

    def pack(self, out: SchedulerOutput) -> tuple[BatchMetadata, StepShape, np.ndarray | None]:
        """The scheduled chunks as one padded numpy batch, and the placeholder tokens' rows in
        the previous step (None without placeholders): :func:`step_inputs.pack_step`."""
        return pack_step(out, self.buckets, self.block_size)

    # ------------------------------------------------------------- block moves
    def _apply_block_moves(self, out: SchedulerOutput) -> None:
        """Swap-out reads first (the freed blocks may be rewritten this step), then
        swap-in writes, then copy-on-write copies."""
        if out.blocks_to_swap_out:
            gpu, cpu = zip(*out.blocks_to_swap_out, strict=True)
            ids = np.zeros(_pad_to_power_of_two(len(gpu)), np.int32)
            ids[:len(gpu)] = gpu
            k, v = jax.device_get(self._programs.read_blocks(self.kv_pool, ids))
            host_k, host_v = self._host_pools()
            host_k[:, list(cpu)] = k[:, :len(gpu)]
            host_v[:, list(cpu)] = v[:, :len(gpu)]
        if out.blocks_to_swap_in:
            cpu, gpu = zip(*out.blocks_to_swap_in, strict=True)
            size = _pad_to_power_of_two(len(gpu))
            host_k, host_v = self._host_pools()
            ids = np.zeros(size, np.int32)
            ids[:len(gpu)] = gpu
            k = np.zeros((host_k.shape[0], size, *host_k.shape[2:]), host_k.dtype)
            v = np.zeros_like(k)
            k[:, :len(gpu)] = host_k[:, list(cpu)]
            v[:, :len(gpu)] = host_v[:, list(cpu)]
            self.kv_pool = self._programs.write_blocks(self.kv_pool, ids, k, v)
        if out.blocks_to_copy:
            src, dst = zip(*out.blocks_to_copy, strict=True)
            size = _pad_to_power_of_two(len(src))
            src_ids, dst_ids = np.zeros(size, np.int32), np.zeros(size, np.int32)
            src_ids[:len(src)], dst_ids[:len(dst)] = src, dst
            self.copy_blocks(src_ids, dst_ids)

    def copy_blocks(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
        """Copies KV blocks ``src_ids`` to ``dst_ids`` (i32[n], padded with 0 -> 0)."""
        if self.mirror is not None:
            self.mirror.send(("copy_blocks", src_ids, dst_ids))
        self.kv_pool = self._programs.copy(self.kv_pool, src_ids, dst_ids)

    def _host_pools(self) -> tuple[np.ndarray, np.ndarray]:
        if self._host_k is None:
            raise ValueError("a swap was scheduled but the engine has no swap space")
        return self._host_k, self._host_v
