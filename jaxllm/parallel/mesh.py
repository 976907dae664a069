"""The device mesh: axes ``dp`` (data), ``pp`` (pipeline) and ``tp`` (tensor). Only ``tp`` is
used today; ``dp`` and ``pp`` have size 1 until multi-host serving gives them devices, so
partition specs that name ``tp`` stay valid when they grow."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding

TP_AXIS = "tp"
MESH_AXES = ("dp", "pp", TP_AXIS)


def check_device_count(tensor_parallel_size: int, devices: list | None = None) -> None:
    """Raises ValueError naming the flag unless 1 <= size <= the visible local devices."""
    devices = list(jax.local_devices() if devices is None else devices)
    if not 1 <= tensor_parallel_size <= len(devices):
        raise ValueError(
            f"--tensor-parallel-size {tensor_parallel_size}: must be between 1 and the number "
            f"of visible devices ({len(devices)} {devices[0].platform} device(s))")


def make_mesh(tensor_parallel_size: int, devices: list | None = None) -> Mesh:
    """A (1, 1, N) mesh over the first ``tensor_parallel_size`` local devices."""
    devices = list(jax.local_devices() if devices is None else devices)
    check_device_count(tensor_parallel_size, devices)
    # Auto axes: XLA propagates the params' shardings through the unchanged model code and
    # places the collectives (explicit axes would make every op state its output sharding).
    return jax.make_mesh((1, 1, tensor_parallel_size), MESH_AXES,
                         axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices[:tensor_parallel_size])


def tensor_parallel_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[TP_AXIS]


def mesh_of(tree: Any) -> Mesh | None:
    """The mesh ``tree``'s arrays are sharded over (params or a pool from
    :mod:`jaxllm.parallel.sharding`), or None for single-device arrays and abstract values."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and TP_AXIS in sharding.mesh.axis_names \
                and sharding.mesh.shape[TP_AXIS] > 1:
            return sharding.mesh
    return None
