"""An accelerator's memory: its size, what this process may allocate, and what is in use.

JAX's default allocator (XLA's BFC arena) reports its limit and the bytes in use. XLA's VMM
allocator reports nothing, and XLA switches to it by itself under any command-buffer update
mode but the default (``--xla_gpu_command_buffer_update_mode=SKIP_TEMP``, which keeps a
step's temporaries at one address so its CUDA graph is not re-recorded); so does the
platform allocator (``XLA_PYTHON_CLIENT_ALLOCATOR=platform``). There the CUDA driver answers
(``cuMemGetInfo`` in the device's primary context, the one XLA runs in): in use is everything
on the device, total - free (this process's context and other processes' memory included, as
vLLM counts non-torch memory), and the limit is JAX's memory fraction of the total, which the
VMM allocator applies too.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os

logger = logging.getLogger(__name__)
DEFAULT_JAX_MEM_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION when unset
JAX_STATS = "JAX's allocator"
CUDA_DRIVER = "the CUDA driver"


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    total: int  # bytes on the device
    limit: int  # bytes this process's allocator may take
    in_use: int  # bytes allocated now (JAX: this process's; the driver: the whole device's)
    source: str  # JAX_STATS or CUDA_DRIVER


def jax_memory_fraction(environ=os.environ) -> float:
    return float(environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_JAX_MEM_FRACTION))


def device_memory(device) -> DeviceMemory | None:
    """``device``'s memory from JAX's statistics, else (a CUDA device under an allocator that
    keeps none) from the driver; None on CPU or where neither says."""
    if device.platform == "cpu":
        return None
    fraction = jax_memory_fraction()
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        limit = int(stats["bytes_limit"])
        return DeviceMemory(total=int(limit / fraction), limit=limit,
                            in_use=int(stats.get("bytes_in_use", 0)), source=JAX_STATS)
    info = cuda_memory_info(device.local_hardware_id)
    if info is None:
        return None
    free, total = info
    return DeviceMemory(total=total, limit=int(total * fraction), in_use=total - free,
                        source=CUDA_DRIVER)


@functools.cache
def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def cuda_memory_info(ordinal: int | None) -> tuple[int, int] | None:
    """(free, total) bytes of CUDA device ``ordinal`` (as this process numbers them), asked of
    the driver in the device's primary context; None without a driver or on any error."""
    lib = _libcuda()
    if lib is None or ordinal is None:
        return None
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if lib.cuInit(0) or lib.cuDeviceGet(ctypes.byref(dev), int(ordinal)):
        return None
    if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev):
        return None
    try:
        if lib.cuCtxPushCurrent_v2(ctx):
            return None
        try:
            status = lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        lib.cuDevicePrimaryCtxRelease_v2(dev)
    if status:
        logger.warning("cuMemGetInfo on CUDA device %s failed (CUresult %d)", ordinal, status)
        return None
    return free.value, total.value


def stored_bytes(x) -> int:
    """Bytes an array (or one shard's data) takes on the device. ``nbytes`` counts a byte an
    element for sub-byte types, while XLA stores int4 two to a byte: the N-major 4-bit weights
    (``JAXLLM_INT4_HOPPER``) counted twice their size in the benchmarks' rooflines."""
    import jax

    return x.size * jax.dtypes.itemsize_bits(x.dtype) // 8


__all__ = ["CUDA_DRIVER", "JAX_STATS", "DeviceMemory", "cuda_memory_info", "device_memory",
           "jax_memory_fraction", "stored_bytes"]
