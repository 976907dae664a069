"""Which devices each data-parallel replica (engine-core process) may use, decided in the
launcher before any process starts JAX: JAX claims a device's memory once it starts on it, so
each replica's process is told which devices it sees (``CUDA_VISIBLE_DEVICES``) before then.
Plain Python: reading them here must not start JAX either."""

from __future__ import annotations

import os
from collections.abc import Mapping


def visible_gpus(environ: Mapping[str, str]) -> list[str] | None:
    """The CUDA devices a process started now would see (ids as CUDA_VISIBLE_DEVICES takes
    them), read without initializing JAX (that would claim the GPUs' memory here); None when
    there are none to divide (a CPU host, or JAX told to use another platform)."""
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return None
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d for d in listed.split(",") if d.strip()] or None
    try:
        found = [name for name in os.listdir("/dev") if name.startswith("nvidia")
                 and name[len("nvidia"):].isdigit()]
    except OSError:
        return None
    return [str(i) for i in range(len(found))] or None


def replica_device_env(replica: int, tensor_parallel_size: int,
                       environ: Mapping[str, str]) -> dict[str, str]:
    """What replica ``replica``'s process must see set before JAX starts: on CUDA, devices
    [replica * tp, (replica + 1) * tp) of those visible here; elsewhere nothing (a CPU
    process has its own host devices)."""
    gpus = visible_gpus(environ)
    if gpus is None:
        return {}
    first = replica * tensor_parallel_size
    mine = gpus[first:first + tensor_parallel_size]
    if len(mine) < tensor_parallel_size:
        raise ValueError(f"data-parallel replica {replica} needs GPUs "
                         f"[{first}, {first + tensor_parallel_size}) but {len(gpus)} are "
                         "visible")
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}
