"""Tensor and pipeline parallelism over one ``jax.sharding.Mesh``: the mesh, the
partition-spec table of the params and the KV pool, and the checks a tensor- or
pipeline-parallel size must pass. The model code is the same at every tensor-parallel size:
sharded arrays plus XLA's collectives do the rest, and the attention kernels run per shard
under ``jax.shard_map`` (:mod:`jaxllm.attention`); pipeline stages run the layer stack in one
``shard_map`` over ``pp`` (:mod:`jaxllm.parallel.pipeline`)."""

from jaxllm.parallel.mesh import (
    MESH_AXES,
    PP_AXIS,
    TP_AXIS,
    check_device_count,
    make_mesh,
    mesh_of,
    pipeline_parallel_size,
    tensor_parallel_size,
)
from jaxllm.parallel.sharding import (
    check_pipeline_parallel,
    check_tensor_parallel,
    kv_pool_shardings,
    logits_sharding,
    param_shardings,
    replicated,
    tensor_parallel_config,
)

__all__ = ["MESH_AXES", "PP_AXIS", "TP_AXIS", "check_device_count", "check_pipeline_parallel",
           "check_tensor_parallel", "kv_pool_shardings", "logits_sharding", "make_mesh",
           "mesh_of", "param_shardings", "pipeline_parallel_size", "replicated",
           "tensor_parallel_config", "tensor_parallel_size"]
