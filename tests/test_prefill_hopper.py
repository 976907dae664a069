"""The Hopper (Mosaic GPU) paged prefill kernel against the float32 reference.

On CPU, JAX's GPU interpreter runs the kernel's warpgroups, barriers and TMA page copies as
written, with its two products as register dots (the interpreter has no wgmma), and the
kernel is lowered for an H200 (its Mosaic GPU module built with the wgmma path); compiled, it
runs on a GPU only.

The kernel reads whole pages, page tails past a sequence's length included, and needs them
finite (the engine's pools are zero-initialized and only hold written K/V): the cases here
replace the NaN that ``make_case`` puts there with large finite values, which still show any
key the mask lets through.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.pallas_kernels.paged_attention import paged_attention_reference
from jaxllm.pallas_kernels.paged_attention.prefill_hopper import paged_attention_prefill_hopper
from jaxllm.pallas_kernels.paged_attention.prefill_hopper_config import (
    HopperPrefillConfig,
    smem_bytes,
    unsupported,
)
from jaxllm.pallas_kernels.paged_attention.shapes import HEAD_SHAPES, HeadShape
from paged_attention_cases import TOLERANCES, decode_chunks, make_case

ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
# Prompt chunks over cached prefixes, decodes, a 1023-token prefill; and the shape.
# SmolLM2's group of 3 heads of 64 under one KV head: the interpreter runs a program per query
# head and query block, so the CPU cases keep to one group.
GROUP_OF_3 = HeadShape(3, 1, 64)
MIXED_CHUNKS = [(0, 1), (16, 1), (0, 17), (15, 3), (510, 3), (0, 513), (1000, 23), (1022, 1)]


def finite_case(chunks, heads: str | HeadShape, block_size: int, dtype):
    h = HEAD_SHAPES[heads] if isinstance(heads, str) else heads
    case = make_case(chunks, block_size=block_size, num_q_heads=h.num_q_heads,
                     num_kv_heads=h.num_kv_heads, head_dim=h.head_dim, dtype=dtype)
    q, k, v, *rest = case.args
    loud = lambda x: jnp.where(jnp.isnan(x), jnp.asarray(300.0, x.dtype), x)
    case.args = (q, loud(k), loud(v), *rest)
    return case


def check(case, dtype, config=None, interpret=False):
    kernel = functools.partial(paged_attention_prefill_hopper, scale=case.scale, config=config,
                               interpret=interpret)
    kernel = kernel if interpret else jax.jit(kernel)
    out = np.asarray(kernel(*case.args), np.float32)
    ref = np.asarray(paged_attention_reference(*case.args, scale=case.scale), np.float32)
    n = case.num_real_tokens
    assert out.shape == ref.shape and np.isfinite(out).all()
    np.testing.assert_allclose(out[:n], ref[:n], **TOLERANCES[dtype])
    np.testing.assert_array_equal(out[n:], 0.0)  # padding tokens: 0
    rel = np.linalg.norm(out[:n] - ref[:n]) / np.linalg.norm(ref[:n])
    assert rel < 1e-2, rel


def test_config_and_operands_the_kernel_cannot_take_are_named():
    with pytest.raises(ValueError, match="multiples of 64"):
        HopperPrefillConfig(block_q=32)
    with pytest.raises(ValueError, match=">= 2"):
        HopperPrefillConfig(max_concurrent_steps=1)
    with pytest.raises(ValueError, match="num_programs"):
        HopperPrefillConfig(num_programs=0)
    config = HopperPrefillConfig()
    q = jnp.zeros((4, 32, 128), jnp.bfloat16)
    pool = jnp.zeros((1, 4, 16, 8, 128), jnp.bfloat16)
    assert unsupported(q, pool, None, config) is None
    assert "sliding" in unsupported(q, pool, 64, config)
    assert "2-byte" in unsupported(q, pool.astype(jnp.float8_e4m3fn), None, config)
    assert "2-byte" in unsupported(q.astype(jnp.float32), pool.astype(jnp.float32), None, config)
    assert "head_dim" in unsupported(q[..., :96], pool[..., :96], None, config)
    assert "whole pages" in unsupported(q, jnp.zeros((1, 4, 48, 8, 128), jnp.bfloat16), None,
                                        config)
    # Both warpgroups' q rows and three 128-key K and V slots: 256 KiB, past the 227 a block has.
    too_big = HopperPrefillConfig(block_q=128, max_concurrent_steps=3, v_concurrent_steps=None,
                                  prefetch_q=False)
    assert smem_bytes(too_big, 128, 2) == 256 * 1024
    assert "shared memory" in unsupported(q, pool, None, too_big)
    assert unsupported(q, pool, None, HopperPrefillConfig(
        block_q=128, max_concurrent_steps=2, prefetch_q=False)) is None
    # A second q buffer a warpgroup: 32 KiB more, past the block with 3 slots of 128 keys each.
    both3 = HopperPrefillConfig(v_concurrent_steps=None, prefetch_q=True)
    assert smem_bytes(both3, 128, 2) == 256 * 1024
    assert "shared memory" in unsupported(q, pool, None, both3)
    assert unsupported(q, pool, None, HopperPrefillConfig(prefetch_q=True,
                                                          max_concurrent_steps=2)) is None
    # The default: one V slot fewer than K's, 3 K + 2 V slots of 128 keys and two q buffers.
    assert smem_bytes(config, 128, 2) == 224 * 1024 and unsupported(q, pool, None, config) is None
    with pytest.raises(ValueError, match=">= 2"):
        HopperPrefillConfig(v_concurrent_steps=1)
    with pytest.raises(ValueError, match="sliding"):
        case = finite_case([(0, 5)], "llama3_8b", 16, jnp.bfloat16)
        paged_attention_prefill_hopper(*case.args, scale=case.scale, sliding_window=8)


@pytest.mark.parametrize("heads,config", [
    ("llama3_8b", None), ("llama2_7b", None),
    ("llama3_8b", HopperPrefillConfig(block_kv=64, max_concurrent_steps=4,
                                      v_concurrent_steps=None)),
    ("llama3_8b", HopperPrefillConfig(prefetch_q=False, v_concurrent_steps=None))])
def test_lowers_to_one_mosaic_gpu_kernel_for_the_h200(heads, config):
    """The whole kernel (warpgroups, TMA page copies, wgmma, barriers) lowered for sm_90a on
    a machine without a GPU: what the CPU can check before a GPU compiles it."""
    from jax.sharding import AbstractDevice, AbstractMesh

    h = HEAD_SHAPES[heads]
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    pool = jax.ShapeDtypeStruct((2, 300, 16, h.num_kv_heads, h.head_dim), jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((2048, h.num_q_heads, h.head_dim), jnp.bfloat16), pool, pool,
            i32(), i32(4, 128), i32(4), i32(5), i32(2048))
    h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    with jax.sharding.use_abstract_mesh(h200):
        traced = jax.jit(functools.partial(paged_attention_prefill_hopper, scale=0.1,
                                           config=config)).trace(*args)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1


@pytest.mark.parametrize("prefetch_q,v_slots", [(False, None), (True, None), (True, 2)],
                         ids=["one_q", "prefetch_q", "prefetch_q_v2"])
def test_interpreted_kernel_equals_reference(prefetch_q, v_slots):
    """One group of heads in 64-key steps, so that the sequences take several: slots
    refilled, within an item and across the items a program takes in turn (two programs),
    and a fresh 128-token prompt whose first warpgroup needs one step where the second needs
    two (the first releases the other's). With ``prefetch_q`` each item's q arrives in the
    buffer the item before last stored its output from; with ``v_slots`` 2 the V ring turns
    over faster than K's."""
    check(finite_case([(0, 128), (260, 70)], GROUP_OF_3, 16, jnp.bfloat16), jnp.bfloat16,
          HopperPrefillConfig(block_kv=64, prefetch_q=prefetch_q, v_concurrent_steps=v_slots),
          interpret=True)


def test_interpreter_finds_no_race_where_no_slot_is_refilled():
    """JAX's race detector over the barriers (q, K/V ready, the warpgroups' turns, the output
    store). Where slots are refilled it reports the refill's TMA write against the earlier
    step's read even in a plain one-consumer ring (its async copies do not inherit the
    issuing warpgroup's wait; a synchronous store in the same ring is clean), so the case is
    one with at most max_concurrent_steps steps a program: a program for each item (in
    float16: checked against the reference too)."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
    from jax.experimental.pallas import mosaic_gpu as plgpu

    case = finite_case([(0, 5), (20, 70)], GROUP_OF_3, 16, jnp.float16)
    check(case, jnp.float16, HopperPrefillConfig(block_kv=64, num_programs=64),
          interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not get_races().races_found


@pytest.mark.gpu
@gpu_only
class TestHopperPrefillGPU:
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
    @pytest.mark.parametrize("block_size", [16, 32])
    def test_mixed_chunks(self, dtype, block_size):
        check(finite_case(MIXED_CHUNKS, "llama3_8b", block_size, dtype), dtype)

    def test_mha_heads_and_decodes(self):
        case = finite_case(decode_chunks([1, 40, 513]) + [(0, 300), (64, 130)], "llama2_7b", 16,
                           jnp.bfloat16)
        check(case, jnp.bfloat16)

    @pytest.mark.parametrize("cached", [0, 2048, 8000])
    def test_long_chunk_over_cached_tokens(self, cached):
        check(finite_case([(cached, 2048)], "llama3_8b", 16, jnp.bfloat16), jnp.bfloat16)

    @pytest.mark.parametrize("config", [
        dict(block_q=64, block_kv=64), dict(block_q=128, block_kv=128, max_concurrent_steps=2,
                                            prefetch_q=False),
        dict(max_concurrent_steps=2, v_concurrent_steps=None, prefetch_q=False),
        dict(max_concurrent_steps=4, block_kv=64, v_concurrent_steps=None, prefetch_q=False),
        dict(num_programs=3), dict(max_concurrent_steps=2),
        dict(block_kv=64, max_concurrent_steps=4, v_concurrent_steps=None, num_programs=3),
        dict(num_programs=1000), dict(v_concurrent_steps=None, prefetch_q=False),
        dict(v_concurrent_steps=None, prefetch_q=False, num_programs=3)])
    def test_configs(self, config):
        case = finite_case([(0, 300), (700, 200), (5, 1)], "llama3_8b", 16, jnp.bfloat16)
        check(case, jnp.bfloat16, HopperPrefillConfig(**config))


# --- through the attention dispatch (backend "pallas_mosaic") ---------------------------------


@pytest.fixture
def hopper_calls(monkeypatch):
    """The configs of the mixed path's Hopper kernel calls (``dispatch`` runs op by op)."""
    from jaxllm.pallas_kernels.paged_attention import mixed

    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["config"])
        return paged_attention_prefill_hopper(*args, **kwargs)

    monkeypatch.setattr(mixed, "paged_attention_prefill_hopper", counted)
    return calls


def dispatch(case, backend, sliding_window=None):
    """The dispatch's output, op by op: inside a jitted program, the GPU interpreter's
    warpgroup threads each run jitted code and wait on each other at barriers, and on a
    2-core machine the program holding the CPU client's threads starved them (a hang)."""
    from jaxllm.attention import paged_attention
    from jaxllm.kv_pool import KVPool

    q, k, v, layer = case.args[:4]
    with jax.disable_jit():
        out = paged_attention(q, KVPool(k, v), layer, case.batch, scale=case.scale,
                              sliding_window=sliding_window, backend=backend)
    return np.asarray(out, np.float32)


def test_mosaic_backend_runs_mixed_batches_through_the_hopper_kernel(hopper_calls):
    """Prompt chunks beside decodes: the decodes through the decode kernel, the rest through
    the Hopper kernel (JAX's GPU interpreter here) with ``skip_single_token_seqs``, which
    gives the one-token sequences no block and no store; together equal to the reference."""
    case = finite_case([(0, 70), (16, 1), (130, 9)], GROUP_OF_3, 16, jnp.bfloat16)
    out = dispatch(case, "pallas_mosaic_interpret")
    assert hopper_calls == [HopperPrefillConfig()]
    ref = dispatch(case, "reference")
    n = case.num_real_tokens
    np.testing.assert_allclose(out[:n], ref[:n], **TOLERANCES[jnp.bfloat16])


def test_mosaic_backend_leaves_what_the_hopper_kernel_cannot_take_to_triton(hopper_calls):
    """A sliding window (and, alike, an FP8 pool or a head dim off 64) goes to the Triton
    prefill kernel: same result as the "pallas" path, no Hopper call."""
    case = finite_case([(0, 40), (20, 1)], GROUP_OF_3, 16, jnp.bfloat16)
    out = dispatch(case, "pallas_mosaic_interpret", sliding_window=24)
    assert hopper_calls == []
    n = case.num_real_tokens
    np.testing.assert_array_equal(out[:n], dispatch(case, "pallas_interpret", 24)[:n])


def test_mosaic_backend_is_refused_without_a_hopper_gpu():
    from jaxllm.attention import resolve_backend

    if ON_GPU:
        capability = getattr(jax.devices()[0], "compute_capability", None)
        if capability == "9.0":
            assert resolve_backend("pallas_mosaic") == "pallas_mosaic"
            return
        with pytest.raises(ValueError, match="needs a Hopper GPU"):
            resolve_backend("pallas_mosaic")
    else:
        for backend in ("pallas", "pallas_mosaic"):
            with pytest.raises(ValueError, match="needs a GPU .* its interpreted form"):
                resolve_backend(backend)
    assert resolve_backend("pallas_mosaic_interpret") == "pallas_mosaic_interpret"
