"""Device memory read from JAX's allocator or, where it keeps no statistics (XLA's VMM
allocator, which SKIP_TEMP command buffers switch on), from the CUDA driver; the KV pool sized
from either, and a clear error where neither answers. CPU tests stand a fake GPU device
and a fake driver in; the GPU tests ask the real driver, under XLA's VMM allocator too."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from test_engine import CFG
from tiny_models import random_params

from jaxllm.engine import device_memory as dm
from jaxllm.engine import kv_sizing
from jaxllm.kv_pool import kv_block_bytes
from jaxllm.loading import LoadedModel

GiB = 1 << 30


@dataclasses.dataclass
class FakeGpu:
    stats: dict | None
    platform: str = "gpu"
    device_kind: str = "NVIDIA H200"
    local_hardware_id: int = 3

    def memory_stats(self):
        return self.stats


@pytest.fixture
def driver(monkeypatch):
    """The fake driver's answer per ordinal: (free, total) bytes, or None (no answer)."""
    answers: dict[int, tuple[int, int] | None] = {}
    monkeypatch.setattr(dm, "cuda_memory_info", lambda ordinal: answers.get(ordinal))
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    return answers


def test_jax_statistics_come_first(driver):
    driver[3] = (1 * GiB, 100 * GiB)  # not asked
    memory = dm.device_memory(FakeGpu({"bytes_limit": 75 * GiB, "bytes_in_use": 5 * GiB}))
    assert memory == dm.DeviceMemory(total=100 * GiB, limit=75 * GiB, in_use=5 * GiB,
                                     source=dm.JAX_STATS)


def test_the_driver_answers_for_a_device_without_statistics(driver, monkeypatch):
    driver[3] = (60 * GiB, 140 * GiB)
    memory = dm.device_memory(FakeGpu(None))
    assert memory == dm.DeviceMemory(total=140 * GiB, limit=105 * GiB, in_use=80 * GiB,
                                     source=dm.CUDA_DRIVER)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert dm.device_memory(FakeGpu({})).limit == int(140 * GiB * 0.9)
    assert dm.device_memory(FakeGpu(None, local_hardware_id=0)) is None  # no answer
    assert dm.device_memory(FakeGpu(None, platform="cpu")) is None


@pytest.fixture(scope="module")
def model():
    return LoadedModel("tiny", CFG, random_params(CFG, seed=5), None, jnp.float32)


def plan(model, monkeypatch, device, **overrides):
    monkeypatch.setattr(kv_sizing, "model_device", lambda m: device)
    monkeypatch.setattr(kv_sizing, "activation_bytes", lambda *a, **k: 2 * GiB)
    args = dict(block_size=16, gpu_memory_utilization=0.5, cpu_kv_cache_space=1.0,
                swap_space=0.0, num_gpu_blocks_override=None, max_num_seqs=1 << 20,
                max_model_len=1 << 20, max_num_batched_tokens=64, attention_backend="xla")
    return kv_sizing.plan_kv_blocks(model, **{**args, **overrides})


def test_the_pool_is_sized_from_the_driver_without_statistics(model, monkeypatch, driver):
    driver[3] = (90 * GiB, 140 * GiB)  # 50 GiB in use on the device
    kv = plan(model, monkeypatch, FakeGpu(None))
    # min(0.75 x 140, 0.5 x 140) = 70 GiB, less 50 in use and 2 of activations
    assert kv.num_gpu_blocks == 18 * GiB // kv_block_bytes(CFG, 16, jnp.float32)
    assert "in use on the device (the CUDA driver" in kv.report
    assert "total device memory 140.00 GiB" in kv.report


def test_the_pool_from_jax_statistics_is_unchanged(model, monkeypatch, driver):
    stats = {"bytes_limit": 75 * GiB, "bytes_in_use": 10 * GiB}
    kv = plan(model, monkeypatch, FakeGpu(stats), gpu_memory_utilization=0.9)
    # min(75, 0.9 x 100) = 75 GiB, less 10 in use and 2 of activations
    assert kv.num_gpu_blocks == 63 * GiB // kv_block_bytes(CFG, 16, jnp.float32)
    assert "model weights and buffers take 10.00 GiB" in kv.report


def test_a_gpu_nobody_can_measure_needs_the_override(model, monkeypatch, driver):
    with pytest.raises(ValueError, match="num_gpu_blocks_override"):
        plan(model, monkeypatch, FakeGpu(None))
    kv = plan(model, monkeypatch, FakeGpu(None), num_gpu_blocks_override=40)
    assert kv.num_gpu_blocks == 40


def test_a_cpu_takes_its_host_budget(model, monkeypatch, driver):
    kv = plan(model, monkeypatch, jax.devices("cpu")[0])
    assert kv.num_gpu_blocks == GiB // kv_block_bytes(CFG, 16, jnp.float32)
    assert kv.report.startswith("CPU KV cache space 1.00 GiB")


VMM_PROBE = """
import json, jax
from jaxllm.engine.device_memory import cuda_memory_info, device_memory
device = jax.devices()[0]
x = jax.device_put(jax.numpy.zeros((1 << 28,), jax.numpy.float32))  # 1 GiB
x.block_until_ready()
memory = device_memory(device)
print(json.dumps(dict(stats=device.memory_stats(), driver=cuda_memory_info(
    device.local_hardware_id), memory=memory and memory.__dict__)))
"""


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("update_mode", ["ALWAYS_UPDATE", "SKIP_TEMP"])
def test_the_real_driver_and_xla_allocators(update_mode):
    env = dict(os.environ, XLA_FLAGS=f"--xla_gpu_command_buffer_update_mode={update_mode}",
               XLA_PYTHON_CLIENT_MEM_FRACTION="0.5")
    out = subprocess.run([sys.executable, "-c", VMM_PROBE], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    probe = json.loads(out.strip().splitlines()[-1])
    free, total = probe["driver"]
    memory = probe["memory"]
    assert 0 < free < total and total > 8 * GiB
    if update_mode == "SKIP_TEMP":  # the VMM allocator: no statistics, the driver answers
        assert not probe["stats"] or "bytes_limit" not in probe["stats"]
        assert memory["source"] == dm.CUDA_DRIVER and memory["total"] == total
        assert memory["in_use"] >= GiB  # the array, at least
    else:  # the BFC arena: JAX's statistics, the arena a fraction of the device's memory
        assert memory["source"] == dm.JAX_STATS
        assert abs(memory["total"] - total) < 0.02 * total
        assert memory["in_use"] >= GiB


def test_stored_bytes_count_int4_at_half_a_byte():
    # jax's nbytes counts a byte an int4 element; XLA stores two to a byte
    assert dm.stored_bytes(jnp.zeros((8, 16), jnp.int4)) == 64
    assert dm.stored_bytes(jnp.zeros((8, 16), jnp.bfloat16)) == 256
    assert dm.stored_bytes(jnp.zeros((3,), jnp.float8_e4m3fn)) == 3
