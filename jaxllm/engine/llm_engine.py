"""LLMEngine: requests in, a step at a time, RequestOutputs out.

``add_request`` validates and queues; ``step`` = schedule -> run (device) -> append sampled
tokens, detokenize, check stop conditions, free what finished. The launch and record stages
are :mod:`jaxllm.engine.step_launcher`'s. Not thread-safe: the async engine drives it from one
thread.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence as SequenceABC

import jax
import numpy as np

from jaxllm.attention import resolve_backend, rope_kv_kernel_enabled
from jaxllm.engine.block_manager import BlockManager
from jaxllm.engine.compile_cache import use_compilation_cache
from jaxllm.engine.embeddings import EmbeddingRequests
from jaxllm.engine.engine_config import (
    EngineConfig,
    SchedulerConfig,
    resolve_limits,
    resolve_unroll_layers,
)
from jaxllm.engine.executable_cache import ExecutableCache
from jaxllm.engine.int4_layout import with_int4_layout
from jaxllm.engine.kv_sizing import model_device, plan_kv_blocks, total_device_memory
from jaxllm.engine.memory_errors import out_of_memory_explained
from jaxllm.engine.model_runner import BANNED_WIDTH, ModelRunner
from jaxllm.engine.multihost import NodeGroup
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.outputs import EmbeddingRequestOutput, RequestOutput
from jaxllm.engine.request_outputs import StopDecision, core_output, needs_every_step
from jaxllm.engine.sampler_table import SamplerTable
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from jaxllm.engine.stats import EngineStats
from jaxllm.engine.step_launcher import StepLauncher, _LaunchedStep
from jaxllm.engine.step_programs import stage_step_input
from jaxllm.kv_pool import kv_cache_dtype
from jaxllm.layers import fp8_kernels, int4_fusion
from jaxllm.layers.linear import int4_hopper_mode
from jaxllm.loading import LoadedModel, load_model
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampler_rows import needs_penalties
from jaxllm.sampling_params import RequestOutputKind, SamplingParams
from jaxllm.structured import GrammarCompiler, StructuredOutputs

logger = logging.getLogger(__name__)


class LLMEngine(StepLauncher):
    def __init__(self, config: EngineConfig | None = None, model: LoadedModel | None = None,
                 *, progress: bool = True, usage_context: str = "engine"):
        """``usage_context``: who builds the engine (``engine_config.USAGE_CONTEXTS``: the LLM
        class, the API server or the bare engine), which picks the default limits."""
        config = config or EngineConfig()
        start = time.perf_counter()
        if config.enforce_eager:
            # The analogue of disabling CUDA graphs; only effective before the backend starts.
            flags = os.environ.get("XLA_FLAGS", "")
            if "xla_gpu_enable_command_buffer" not in flags:
                os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_enable_command_buffer=".strip()
        # Multi-host: join the other nodes before anything starts a JAX backend.
        self.nodes = NodeGroup.join(config) if config.nnodes > 1 else None
        if config.compilation_cache_dir and not config.enforce_eager:
            use_compilation_cache(config.compilation_cache_dir)
        config = config.replace(unroll_layers=resolve_unroll_layers(config.unroll_layers,
                                                                    jax.default_backend()))
        backend = resolve_backend(config.attention_backend)  # refused before any loading
        fp8_kernels.check_settings()  # likewise a bad JAXLLM_FP8_*_KERNEL
        stage_step_input()  # and a bad JAXLLM_STAGE_STEP_INPUT
        int4_layout = int4_hopper_mode()  # and a bad JAXLLM_INT4_HOPPER
        int4_fusion.fusion_enabled()  # or JAXLLM_INT4_FUSION
        rope_kv_kernel_enabled()  # or JAXLLM_ROPE_KV_KERNEL
        owned = model is None  # the engine's own load: its arrays may be freed as converted
        with out_of_memory_explained("loading the weights"):
            if model is None:
                model = load_model(config.model, dtype=config.dtype,
                                   load_format=config.load_format, seed=config.seed,
                                   unroll_layers=config.unroll_layers,
                                   tensor_parallel_size=config.tensor_parallel_size,
                                   pipeline_parallel_size=config.pipeline_parallel_size,
                                   quantization=config.quantization,
                                   tokenizer=config.tokenizer)
            elif model.mesh is not None and config.tensor_parallel_size == 1 \
                    and config.pipeline_parallel_size == 1:
                # An already sharded model brings its own sizes.
                config = config.replace(tensor_parallel_size=model.tensor_parallel_size,
                                        pipeline_parallel_size=model.pipeline_parallel_size)
            # A caller's model keeps its own layout: the engine works on a re-laid-out (and,
            # for tensor parallelism, sharded) copy.
            model = model.with_quantization(config.quantization).with_tensor_parallel(
                config.tensor_parallel_size, config.pipeline_parallel_size,
            ).with_layer_layout(config.unroll_layers)
            model = with_int4_layout(model, int4_layout, donate=owned)
        if model.quantization is not None:
            logger.info("weights: %s", model.quantization.describe())
        loaded = time.perf_counter()
        self.model = model
        self.tokenizer = model.tokenizer
        # Every node must resolve the same limits, and a worker cannot know its leader's
        # usage: multi-node engines take the server's defaults.
        device = model_device(model)
        config = resolve_limits(config, model.config.max_position_embeddings,
                                jax.default_backend(), total_device_memory(device),
                                device.device_kind,
                                usage_context if config.nnodes == 1 else "api_server")
        max_model_len, max_batched = config.max_model_len, config.max_num_batched_tokens
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, model.dtype)
        plan = plan_kv_blocks(
            model, block_size=config.block_size,
            gpu_memory_utilization=config.gpu_memory_utilization,
            cpu_kv_cache_space=config.cpu_kv_cache_space, swap_space=config.swap_space,
            num_gpu_blocks_override=config.num_gpu_blocks_override,
            max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_batched, attention_backend=backend, kv_dtype=kv_dtype)
        logger.info(plan.report)
        if self.nodes is not None:
            plan = self.nodes.agree_kv_plan(plan)
        if -(-max_model_len // config.block_size) > plan.num_gpu_blocks - 1:
            fits = (plan.num_gpu_blocks - 1) * config.block_size
            raise ValueError(
                f"The model's max seq len ({max_model_len}) is larger than the maximum number "
                f"of tokens that can be stored in KV cache ({fits}). Try increasing "
                "gpu_memory_utilization or decreasing max_model_len.")
        self.config = config
        self.kv_plan = plan
        # The pools first: an allocation that cannot succeed fails here, before the host's
        # block lists are built for it.
        with out_of_memory_explained("allocating the KV cache"):
            self.runner = ModelRunner(
                model, block_size=config.block_size, num_gpu_blocks=plan.num_gpu_blocks,
                num_cpu_blocks=plan.num_cpu_blocks, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max_batched, max_model_len=max_model_len,
                attention_backend=backend, bucket_table_width=backend == "reference",
                kv_dtype=kv_dtype, executable_cache=ExecutableCache.open(
                    config.compilation_cache_dir) if config.compilation_cache_dir
                and not config.enforce_eager else None)
        allocated = time.perf_counter()
        self.block_manager = BlockManager(
            plan.num_gpu_blocks, config.block_size, num_cpu_blocks=plan.num_cpu_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            prefix_caching_hash_algo=config.prefix_caching_hash_algo)
        self._seq_ids = itertools.count()
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, max_batched, max_model_len,
                            config.scheduling_policy, config.preemption_mode),
            self.block_manager, self._seq_ids.__next__)
        self.eos_token_ids = tuple(model.config.eos_token_ids)
        self.structured = None if self.tokenizer is None else StructuredOutputs(
            GrammarCompiler(self.tokenizer, model.config.vocab_size, self.eos_token_ids))
        self.embeddings = EmbeddingRequests()
        self.sampler_table = SamplerTable(self._banned_ids)  # sampler settings per sequence
        self._rng = np.random.default_rng(config.seed)
        self._groups: dict[str, SequenceGroup] = {}
        self._prompts: dict[str, str | None] = {}
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids,
                                                self.scheduler.finish_seq)
        self._inflight: _LaunchedStep | None = None
        self._num_penalty_requests = 0
        # False: step() returns only finished requests (offline use; saves host time).
        self.stream_outputs = True
        self.token_deltas = False  # True: outputs are tokens for front ends to detokenize
        self.stats = EngineStats()
        self.warm_up_seconds = 0.0
        if not config.enforce_eager:
            with out_of_memory_explained("compiling the step programs"):
                self.warm_up_seconds = self.runner.warm_up(progress)
        if self.nodes is not None and self.nodes.is_leader:  # from here on, the workers
            self.runner.mirror = self.nodes.broadcaster()  # launch what this runner launches
        # Where start-up time goes (issue 16's warm restart), for the log and the benchmarks.
        self.startup_seconds = {"weights": loaded - start, "kv_cache": allocated - loaded,
                                "warm_up": self.warm_up_seconds}
        warm = self.runner.warm_up_report or {"programs": 0, "cached": 0, "load_seconds": 0.0,
                                              "compile_seconds": 0.0, "first_run_seconds": 0.0}
        logger.info("engine ready in %.1f s: weights %.1f s, KV cache and plan %.1f s, warm-up "
                    "%.1f s (%d step buckets, %d programs: %d loaded from the executable cache "
                    "in %.1f s, %d compiled or read from the compile cache in %.1f s, first "
                    "runs %.1f s)",
                    time.perf_counter() - start, loaded - start, allocated - loaded,
                    self.warm_up_seconds, len(self.runner.buckets.all_shapes()),
                    warm["programs"], warm["cached"], warm["load_seconds"],
                    warm["programs"] - warm["cached"], warm["compile_seconds"],
                    warm["first_run_seconds"])

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | None = None,
                    params: SamplingParams | PoolingParams | None = None, *,
                    prompt_token_ids: SequenceABC[int] | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> SequenceGroup:
        """Queues one request: generation (SamplingParams) or an embedding (PoolingParams);
        raises ValueError with a clear message on bad input."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is not None:
            # The prompt's last position is a sample row whose pooled hidden state becomes
            # the embedding; its token is dropped.
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        params = params or SamplingParams()
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("either prompt or prompt_token_ids must be given")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids")
            prompt_token_ids = self.tokenizer(prompt)["input_ids"]
        tokens = [int(t) for t in prompt_token_ids]
        vocab = self.model.config.vocab_size
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is out of vocabulary (vocab size {vocab})")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError("priority other than 0 needs --scheduling-policy priority")
        if params.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("structured_outputs needs a model with a tokenizer")
            self.structured.compile(params.structured_outputs)  # cached; raises if bad
        banned = self._banned_ids(params)
        if params.min_tokens and len(banned) > BANNED_WIDTH:
            raise ValueError(f"min_tokens with more than {BANNED_WIDTH} stop/EOS token ids is "
                             "not supported")
        seed = params.seed if params.seed is not None else int(self._rng.integers(1 << 31))
        seq = Sequence(next(self._seq_ids), tokens, index=0, seed=seed)
        seq.output_limit = min(params.max_tokens or self.config.max_model_len,
                               self.config.max_model_len - len(tokens))
        group = SequenceGroup(request_id, [seq], params, arrival_time, priority,
                              reads_every_position=pooling is not None
                              and pooling.needs_every_position)
        self.scheduler.add(group)  # raises RequestRejectedError (a ValueError) if it can't fit
        if pooling is not None:
            self.embeddings.add(request_id, seq.seq_id, pooling)
        else:
            self.output_processor.attach_detokenizer(seq, params)
        self._groups[request_id] = group
        self._prompts[request_id] = prompt
        if needs_penalties(params):
            self._num_penalty_requests += 1
        return group

    def abort_request(self, request_ids: str | SequenceABC[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for request_id in ids:
            group = self.scheduler.abort(request_id)
            if group is not None:
                outputs.append(self._finish_group(group))
        return outputs

    def ship_token_deltas(self) -> None:
        """From now on (call it before any request) ``step`` and ``abort_request`` return
        each request's new token ids as :func:`~jaxllm.engine.request_outputs.core_output`
        tuples, and this engine no longer detokenizes: the front ends do, and tell it
        (``stop_sequences``) which samples a stop string ended. The engine-core process."""
        self.token_deltas = True
        self.output_processor.tokenizer = None  # no detokenizer is attached from now on

    def stop_sequences(self, stops: SequenceABC[StopDecision]) -> None:
        """Finishes the samples in which a front end found a stop string (finish reason
        "stop": it frees their blocks; their final output is built at the next step)."""
        for request_id, index, stop_str in stops:
            group = self._groups.get(request_id)
            for seq in group.seqs if group is not None else ():
                if seq.index == index and not seq.status.is_finished:
                    seq.stop_reason = stop_str
                    self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or self.output_processor.has_pending
                or self._inflight is not None)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # -------------------------------------------------------------------- step
    @out_of_memory_explained("running a step")
    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the outputs of every request that progressed.

        With async scheduling (the default) the device is kept one step ahead. A call
        schedules step k+1 and launches it before step k's samples reach the host (its inputs
        take them from the device), then turns step k-1's tokens into text and outputs while
        the device computes, then waits for step k and records its tokens. So what lies
        between the end of step k on the device and the launch of step k+2 is only the
        recording of k's tokens and the scheduling and packing of k+2: detokenization, stop
        strings and outputs are off that path. Outputs trail the device by up to two steps, and
        a request that stops costs one or two wasted tokens. Steps with repetition/presence/
        frequency penalties run synchronously (the sampler must see the previous token).

        A step with constrained rows (structured outputs) launches its forward at once; its
        sampler needs the grammar bitmask of the tokens before it. The moment step k's tokens
        reach the host, one task on the bitmask thread feeds them to the grammars (outside
        the GIL, while this thread fills them into their sequences; the sequences whose
        grammar is complete stop before anything else), then fills step k+1's bitmask while
        the next call schedules and packs step k+2; that call then launches k+1's sampler,
        and step k+2 behind it.
        """
        stats = self.stats
        outputs: list[RequestOutput] = []
        sync = not self.config.async_scheduling or bool(self._num_penalty_requests)
        launched, self._inflight = self._inflight, None
        if launched is not None and sync:  # penalties arrived while a step was in flight
            self._finish_launch(launched)
            self._record(launched)
            launched = None
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        prepared = self.runner.prepare_forward(out, self.embeddings.in_step(out)) \
            if out.scheduled else None
        if launched is not None:
            self._finish_launch(launched)
        step = self._launch(out, prepared, launched.pending if launched else None) \
            if prepared is not None else None
        stats.schedule_seconds += t1 - t0
        stats.prepare_seconds += time.perf_counter() - t1
        outputs += self._emit_outputs()  # the tokens recorded by the previous call
        if launched is not None:
            self._record(launched, step)
        if step is not None and step.constrained and step.grammar is None and not sync:
            step.grammar, _ = self._start_grammar(None, None, step)  # nothing recorded now
        if step is not None and sync:
            self._finish_launch(step)
            self._record(step)
            step = None
        if step is None:
            outputs += self._emit_outputs()  # nothing in flight: finish the last tokens
        self._inflight = step
        return outputs

    def _banned_ids(self, params: SamplingParams) -> tuple[int, ...]:
        eos = () if params.ignore_eos else self.eos_token_ids
        return tuple(dict.fromkeys(eos + params.stop_token_ids))

    def _emit_outputs(self) -> list[RequestOutput]:
        """Detokenizes the recorded tokens, applies stop strings, builds outputs."""
        start = time.perf_counter()
        outputs = self._build_outputs()
        self.stats.output_seconds += time.perf_counter() - start
        return outputs

    def _build_outputs(self) -> list[RequestOutput]:
        touched = self.output_processor.detokenize()
        if self.token_deltas:  # a front end detokenizes: stop strings need every step's tokens
            outputs = [core_output(g, self._prompts.get(g.request_id)) for g in touched
                       if not g.is_finished and needs_every_step(g, self.stream_outputs)]
        else:
            outputs = [RequestOutput.from_group(g, self._prompts.get(g.request_id))
                       for g in touched if self.stream_outputs and not g.is_finished
                       and g.params.output_kind is not RequestOutputKind.FINAL_ONLY]
        outputs += [self._finish_group(g) for g in self.scheduler.pop_finished()]
        return outputs

    def _finish_group(self, group: SequenceGroup) -> RequestOutput | EmbeddingRequestOutput:
        group.metrics.finished_time = time.monotonic()
        if needs_penalties(group.params) and group.request_id in self._groups:
            self._num_penalty_requests -= 1
        for seq in group.seqs:
            reason = seq.status.finish_reason or "abort"
            self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
            self.sampler_table.remove(seq.seq_id)
        self._groups.pop(group.request_id, None)
        if self.structured is not None and group.params.structured_outputs is not None:
            for seq in group.seqs:
                self.structured.free(seq.seq_id)
        prompt = self._prompts.pop(group.request_id, None)
        if self.embeddings.is_embedding(group.request_id):
            return self.embeddings.output(group, prompt)
        if self.token_deltas:
            return core_output(group, prompt)
        return RequestOutput.from_group(group, prompt)
