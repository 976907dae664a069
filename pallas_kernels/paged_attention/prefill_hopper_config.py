"""The Hopper prefill kernel's config (:class:`HopperPrefillConfig`) and what it can take:
its shared-memory budget, the operands it refuses and the programs it keeps resident; the
kernel is :mod:`.prefill_hopper`'s."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class HopperPrefillConfig:
    block_q: int = 64  # rows per compute warpgroup (a program: 2 x block_q tokens)
    block_kv: int = 128  # keys per step: whole pages
    # K slots in flight: 3 K and V slots (192 KiB at head_dim 128) took a 2k-token chunk
    # over no cached keys from 178 TFLOP/s (2) to 215 on the H200.
    max_concurrent_steps: int = 3
    # V slots (None: as many as K's). V is read after K each step, so a shallower V ring
    # leaves shared memory for prefetch_q with 128-key steps: 3 K + 2 V slots and two q
    # buffers, 224 KiB.
    v_concurrent_steps: int | None = 2
    # Resident programs, each taking work items in turn (None: as many as the device runs at
    # once, from its SM count; 2 under the interpreter).
    num_programs: int | None = None
    # Two q buffers a warpgroup: the next item's q loads under this item's steps (+32 KiB at
    # block_q 64). With 3 K + 2 V slots, on the H200 (benchmarks/RESULTS.md, 2026-12-04):
    # 235 / 323 / 439 TFLOP/s over 0 / 2k / 8k cached tokens against 209 / 336 / 432 with one
    # q buffer and 3 + 3 slots; the engine's chunks are mostly short, where it gains most.
    # (Both timed with the step loop before a904c45; after it, on another machine, 3 + 3
    # slots with one q buffer led at 2k and 8k cached and trailed at 0: RESULTS.md, call 4.)
    prefetch_q: bool = True

    @property
    def q_buffers(self) -> int:  # q (then output) buffers a compute warpgroup
        return 2 if self.prefetch_q else 1

    @property
    def v_steps(self) -> int:  # V slots in flight
        return self.v_concurrent_steps or self.max_concurrent_steps

    def __post_init__(self):
        if self.block_q % 64 or self.block_kv % 64:
            raise ValueError(f"block_q={self.block_q} and block_kv={self.block_kv} must be "
                             "multiples of 64 (wgmma tiles)")
        if min(self.max_concurrent_steps, self.v_steps) < 2:
            # one slot: the two warpgroups would deadlock
            raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} and "
                             f"v_concurrent_steps={self.v_concurrent_steps} must be >= 2")
        if self.num_programs is not None and self.num_programs < 1:
            raise ValueError(f"num_programs={self.num_programs} must be >= 1")


HOPPER_SMEM_BYTES = 227 * 1024  # shared memory one block may take on sm_90


def smem_bytes(config: HopperPrefillConfig, head_dim: int, itemsize: int) -> int:
    """The kernel's buffers: both warpgroups' q (then output) rows and the K and V rings."""
    rows = (2 * config.block_q * config.q_buffers
            + (config.max_concurrent_steps + config.v_steps) * config.block_kv)
    return rows * head_dim * itemsize


def unsupported(q: jax.Array, k_pool: jax.Array, sliding_window: int | None,
                config: HopperPrefillConfig) -> str | None:
    """Why the kernel cannot take these operands (None: it can)."""
    *_, block_size, _, head_dim = k_pool.shape
    if sliding_window is not None:
        return "sliding windows are not supported"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k_pool.dtype != q.dtype:
        return f"q {q.dtype} and pool {k_pool.dtype} must be one 2-byte float dtype"
    if head_dim % 64:
        return f"head_dim={head_dim} must be a multiple of 64"
    if config.block_kv % block_size or block_size % 8:
        return (f"block_kv={config.block_kv} must be whole pages of {block_size} tokens, "
                "pages a multiple of 8")
    need = smem_bytes(config, head_dim, q.dtype.itemsize)
    if need > HOPPER_SMEM_BYTES:
        return (f"{config} needs {need} bytes of shared memory at head_dim={head_dim}; a "
                f"Hopper block has {HOPPER_SMEM_BYTES}")
    return None


H200_SMS = 132


def resident_programs(interpret) -> int:
    """One block per SM: the compute warpgroups' 232 registers a thread take the register
    file. Under the interpreter 2, so that programs take several items each."""
    if interpret:
        return 2
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    return getattr(gpus[0], "core_count", H200_SMS) if gpus else H200_SMS
