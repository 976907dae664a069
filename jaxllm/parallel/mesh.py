"""The device mesh: axes ``dp`` (data), ``pp`` (pipeline) and ``tp`` (tensor). ``tp`` splits
every layer's heads and features (:mod:`jaxllm.parallel.sharding`), ``pp`` splits the layer
stack into stages (:mod:`jaxllm.parallel.pipeline`); ``dp`` has size 1 (data-parallel replicas
are separate engines), so partition specs that name it stay valid if it grows."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding

TP_AXIS = "tp"
PP_AXIS = "pp"
MESH_AXES = ("dp", PP_AXIS, TP_AXIS)


def check_device_count(tensor_parallel_size: int, devices: list | None = None,
                       pipeline_parallel_size: int = 1) -> None:
    """Raises ValueError naming the flags unless 1 <= tp * pp <= the visible devices (every
    process's under ``jax.distributed``)."""
    devices = list(jax.devices() if devices is None else devices)  # every process's
    needed = tensor_parallel_size * pipeline_parallel_size
    if pipeline_parallel_size == 1 and not 1 <= tensor_parallel_size <= len(devices):
        raise ValueError(
            f"--tensor-parallel-size {tensor_parallel_size}: must be between 1 and the number "
            f"of visible devices ({len(devices)} {devices[0].platform} device(s))")
    if pipeline_parallel_size < 1 or tensor_parallel_size < 1 or needed > len(devices):
        raise ValueError(
            f"--tensor-parallel-size {tensor_parallel_size} x --pipeline-parallel-size "
            f"{pipeline_parallel_size}: both must be >= 1 and their product ({needed} devices) "
            f"at most the number of visible devices ({len(devices)} {devices[0].platform} "
            "device(s))")


def make_mesh(tensor_parallel_size: int, devices: list | None = None,
              pipeline_parallel_size: int = 1) -> Mesh:
    """A (1, pp, tp) mesh over the first ``tp * pp`` devices (every process's, in
    ``jax.devices()`` order); each stage's ``tp`` devices are consecutive (on one host's GPUs,
    the NVLink neighbours; across hosts, a stage per host when tp is a host's device count)."""
    devices = list(jax.devices() if devices is None else devices)  # every process's
    check_device_count(tensor_parallel_size, devices, pipeline_parallel_size)
    # Auto axes: XLA propagates the params' shardings through the unchanged model code and
    # places the collectives (explicit axes would make every op state its output sharding).
    return jax.make_mesh((1, pipeline_parallel_size, tensor_parallel_size), MESH_AXES,
                         axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices[:tensor_parallel_size * pipeline_parallel_size])


def tensor_parallel_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[TP_AXIS]


def pipeline_parallel_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[PP_AXIS]


def mesh_of(tree: Any) -> Mesh | None:
    """The mesh ``tree``'s arrays are sharded over (params or a pool from
    :mod:`jaxllm.parallel.sharding`), or None for single-device arrays and abstract values."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and TP_AXIS in sharding.mesh.axis_names \
                and sharding.mesh.size > 1:
            return sharding.mesh
    return None
