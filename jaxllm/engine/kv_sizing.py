"""Sizing the KV pool: how many blocks fit next to the weights and the activations.

GPU (as vLLM): ``device memory x gpu_memory_utilization - bytes already in use (weights)
- the compiled step's activation peak at max_num_batched_tokens``, divided by the bytes of
one block across all layers; the memory as device_memory.py reads it (JAX's allocator, or
the CUDA driver under an allocator that keeps no statistics). CPU: a fixed host budget
(``cpu_kv_cache_space`` GiB).
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from jaxllm.batch import batch_spec, pack_batch
from jaxllm.engine.device_memory import JAX_STATS, device_memory
from jaxllm.kv_pool import kv_block_bytes, new_kv_pool
from jaxllm.loading import LoadedModel
from jaxllm.models.llama import make_forward
from jaxllm.parallel import kv_pool_shardings
from jaxllm.sampler_rows import build_sampling_metadata
from jaxllm.sampling import sample

logger = logging.getLogger(__name__)
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class KVPlan:
    num_gpu_blocks: int  # including the null block
    num_cpu_blocks: int
    block_bytes: int
    report: str


def activation_bytes(model: LoadedModel, num_tokens: int, num_seqs: int, table_width: int,
                     attention_backend: str, kv_dtype=None) -> int:
    """Temporary device memory of the jitted step at its largest shape (compiled, not run),
    for the model's layer layout and a pool of ``kv_dtype`` (None: the model's dtype)."""
    cfg = model.config
    forward = make_forward(cfg, model.dtype, attention_backend, model.mesh)

    def step(params, kv_pool, batch, md):
        logits, kv_pool = forward(params, kv_pool, batch)
        return sample(logits, md, num_logprobs=0, use_penalties=False), kv_pool

    pool = jax.eval_shape(lambda: new_kv_pool(cfg, 2, 16, kv_dtype or model.dtype,
                                              unroll_layers=model.unroll_layers,
                                              mesh=model.mesh))  # the stages' layout
    if model.mesh is not None:  # per device: the pool split as the engine splits it
        pool = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            pool, kv_pool_shardings(pool, model.mesh))
    batch = batch_spec(pack_batch([], 16, num_tokens=num_tokens, num_seqs=num_seqs,
                                  table_width=table_width, num_logits=num_seqs))
    md = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                      build_sampling_metadata([], num_seqs, 0, 8))
    compiled = jax.jit(step).lower(model.params, pool, batch, md).compile()
    analysis = compiled.memory_analysis()
    return int(getattr(analysis, "temp_size_in_bytes", 0) or 0)


def model_device(model: LoadedModel):
    """The device that stands for all of the model's (their shares are equal)."""
    return model.mesh.devices.flat[0] if model.mesh is not None else jax.devices()[0]


def total_device_memory(device) -> float | None:
    """An accelerator's memory in bytes; None on CPU or when neither JAX nor the driver
    says."""
    memory = device_memory(device)
    return None if memory is None else memory.total


def plan_kv_blocks(model: LoadedModel, *, block_size: int, gpu_memory_utilization: float,
                   cpu_kv_cache_space: float, swap_space: float,
                   num_gpu_blocks_override: int | None, max_num_seqs: int, max_model_len: int,
                   max_num_batched_tokens: int, attention_backend: str,
                   kv_dtype=None) -> KVPlan:
    kv_dtype = kv_dtype or model.dtype  # the pool's dtype (--kv-cache-dtype)
    per_block = kv_block_bytes(model.config, block_size, kv_dtype)
    useful = 1 + max_num_seqs * -(-max_model_len // block_size)  # more never gets used
    num_cpu = min(int(swap_space * GiB) // per_block, useful)  # the host holds whole blocks
    # Tensor parallel: each device holds its KV heads' share of every block, and its own
    # weights' share; pipeline parallel: its stage's layers' share. The first device stands
    # for all (their shares are equal).
    tp = model.tensor_parallel_size * model.pipeline_parallel_size
    device_block = per_block // tp
    device = model_device(model)
    memory = device_memory(device)
    if num_gpu_blocks_override is not None:
        num_gpu = num_gpu_blocks_override
        report = f"KV blocks set by num_gpu_blocks_override: {num_gpu}"
    elif memory is not None:
        budget = min(memory.limit, memory.total * gpu_memory_utilization)
        activations = activation_bytes(model, max_num_batched_tokens,
                                       min(max_num_seqs, max_num_batched_tokens),
                                       -(-max_model_len // block_size), attention_backend,
                                       kv_dtype)
        kv_bytes = budget - memory.in_use - activations
        if kv_bytes < 2 * device_block:
            raise ValueError(
                "No available memory for the cache blocks. Try increasing "
                f"gpu_memory_utilization (now {gpu_memory_utilization}) or lowering "
                "max_num_batched_tokens.")
        num_gpu = int(min(kv_bytes // device_block, useful))
        in_use = ("model weights and buffers take" if memory.source == JAX_STATS else
                  f"in use on the device ({memory.source}: weights, buffers, CUDA contexts)")
        report = (f"total device memory {memory.total / GiB:.2f} GiB x gpu_memory_utilization "
                  f"({gpu_memory_utilization:.2f}) = {budget / GiB:.2f} GiB; {in_use} "
                  f"{memory.in_use / GiB:.2f} GiB; activation peak takes "
                  f"{activations / GiB:.2f} GiB; the rest of the memory reserved for KV "
                  f"cache is {kv_bytes / GiB:.2f} GiB")
    elif device.platform != "cpu":
        raise ValueError(
            f"{device.device_kind} reports no memory statistics (JAX's allocator keeps none "
            "under this XLA_FLAGS / XLA_PYTHON_CLIENT_ALLOCATOR, and the CUDA driver did not "
            "answer), so the KV cache cannot be sized: set num_gpu_blocks_override "
            "(--num-gpu-blocks-override).")
    else:
        num_gpu = int(min(cpu_kv_cache_space * GiB // per_block, useful))
        report = f"CPU KV cache space {cpu_kv_cache_space:.2f} GiB"
    per_device = f" per device, over {tp} devices" if tp > 1 else ""
    report += (f"; # KV blocks: {num_gpu} ({(num_gpu - 1) * block_size} tokens, "
               f"{device_block / (1 << 20):.2f} MiB each{per_device}), # swap blocks: "
               f"{num_cpu}; maximum "
               f"concurrency for {max_model_len} tokens per request: "
               f"{(num_gpu - 1) * block_size / max_model_len:.2f}x")
    return KVPlan(num_gpu, num_cpu, per_block, report)


__all__ = ["KVPlan", "activation_bytes", "model_device", "plan_kv_blocks",
           "total_device_memory"]
