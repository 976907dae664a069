"""The int4 GEMV over the N-major weight (gemv_nk.py; ``JAXLLM_INT4_HOPPER=on``'s layout for
1-4 tokens): its words are the int4 bytes, its result the reference's (interpreted on CPU,
compiled on a GPU), the shapes it refuses named, its Triton lowering for the H200, and the
engine's N-major projections routed to it by token count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
from jaxllm.pallas_kernels.quantized_matmul import (
    Int4GemvNKConfig,
    int4_gemv_nk,
    int4_matmul_reference,
    nk_gemv_unsupported,
)
from jaxllm.pallas_kernels.quantized_matmul.gemv_nk import FLIP, nk_gemv_config
from jaxllm.pallas_kernels.quantized_matmul.hopper import centred_zeros_of, hopper_weight
from test_int4_kernel import assert_close, int4_weight

CASES = [  # k, n, group, tokens, dtype, config (None: nk_gemv_config's)
    (512, 256, 128, 1, jnp.float32, None),
    (512, 256, 128, 1, jnp.bfloat16, Int4GemvNKConfig(block_n=64, num_splits=1)),
    (256, 100, 64, 2, jnp.bfloat16, Int4GemvNKConfig(block_n=64, splits_sum="last")),
    (512, 192, 32, 3, jnp.bfloat16, Int4GemvNKConfig(block_n=64)),
    (1024, 128, 128, 4, jnp.float32, Int4GemvNKConfig(block_n=32, num_splits=4)),
    (1024, 96, 256, 2, jnp.float32, Int4GemvNKConfig(block_n=32, splits_sum="atomic")),
    # x read as it is and scaled in the kernel
    (512, 256, 128, 1, jnp.bfloat16, Int4GemvNKConfig(x_in_kernel=True)),
    (256, 100, 64, 3, jnp.bfloat16, Int4GemvNKConfig(block_n=64, x_in_kernel=True,
                                                     splits_sum="last")),
    (512, 64, 32, 2, jnp.float32, Int4GemvNKConfig(block_n=32, x_in_kernel=True)),
    # each step's sum of x taken by XLA before the call, over splits and with x in the kernel
    (1024, 128, 128, 1, jnp.bfloat16, Int4GemvNKConfig(block_n=32, num_splits=4,
                                                       x_sums_before=True)),
    (256, 100, 64, 3, jnp.float32, Int4GemvNKConfig(block_n=64, x_sums_before=True,
                                                    splits_sum="last")),
    (512, 256, 32, 2, jnp.bfloat16, Int4GemvNKConfig(x_in_kernel=True, x_sums_before=True)),
    # several steps an iteration (their loads first): one group each, two steps of one
    # group (256 wide), with the sums before the call and the last split summing
    (1024, 128, 128, 1, jnp.bfloat16, Int4GemvNKConfig(block_n=32, num_splits=2,
                                                       unroll_steps=4)),
    (1024, 96, 256, 2, jnp.float32, Int4GemvNKConfig(block_n=32, unroll_steps=2)),
    (512, 100, 32, 3, jnp.float32, Int4GemvNKConfig(block_n=64, unroll_steps=2,
                                                    x_sums_before=True, splits_sum="last")),
]


@pytest.mark.parametrize("k,n,group,m,dtype,config", CASES)
def test_equals_reference(k, n, group, m, dtype, config):
    w = int4_weight(k, n, group, dtype, seed=m + n)
    x = jnp.asarray(np.random.default_rng(k + m).standard_normal((m, k)), dtype)
    x = x.at[:, 3].set(0)  # a zero activation adds nothing, its share of the zero point too
    want = int4_matmul_reference(x, w.qweight, w.scales, w.zeros, group_size=group)
    nk = hopper_weight(w.qweight)
    got = int4_gemv_nk(x, nk, w.scales, w.zeros, group_size=group, interpret=True,
                       config=config)
    assert got.shape == (m, n)
    assert_close(got, want, x, w, scale_on_output=True)
    # the engine's stored form: zero points centred in the scales' dtype
    centred = int4_gemv_nk(x, nk, w.scales, centred_zeros_of(w.zeros, w.scales.dtype),
                           group_size=group, interpret=True, config=config, centred_zeros=True)
    np.testing.assert_array_equal(np.asarray(centred, np.float32), np.asarray(got, np.float32))


def test_the_words_are_the_int4_bytes_with_each_nibble_flipped():
    """int4 [N, K] (q - 8) read as int32 [N, K/8]: nibble j of word w is element 8w + j, q ^ 8;
    XOR-ed with FLIP the packed words [K/8, N] transposed."""
    w = int4_weight(256, 24, 64, jnp.float32)
    nk = hopper_weight(w.qweight)
    words = jax.lax.bitcast_convert_type(nk.reshape(24, 32, 8), jnp.int32)
    np.testing.assert_array_equal(np.asarray(words ^ FLIP).T, np.asarray(w.qweight))


def test_unsupported_shapes_are_named():
    assert nk_gemv_unsupported(1, 4096, 6144, 128) is None
    assert "1-4" in nk_gemv_unsupported(5, 4096, 6144, 128)
    assert "1-4" in nk_gemv_unsupported(0, 4096, 6144, 128)
    assert "multiple of 8" in nk_gemv_unsupported(1, 4096, 6144, 100)
    assert "16-byte" in nk_gemv_unsupported(1, 4096, 6144, 8)
    assert "splits" in nk_gemv_unsupported(1, 4096, 6144, 128, Int4GemvNKConfig(num_splits=64))
    assert "4 steps an iteration" in nk_gemv_unsupported(
        1, 512, 256, 128, Int4GemvNKConfig(num_splits=4, unroll_steps=4))
    with pytest.raises(ValueError, match="must be a power of two"):
        Int4GemvNKConfig(block_n=100)
    with pytest.raises(ValueError, match="splits_sum"):
        Int4GemvNKConfig(splits_sum="sometimes")
    w = int4_weight(256, 64, 64, jnp.float32)
    with pytest.raises(ValueError, match="1-4"):
        int4_gemv_nk(jnp.ones((8, 256)), hopper_weight(w.qweight), w.scales, w.zeros,
                     group_size=64, interpret=True)


def test_the_column_block_halves_as_the_tokens_double():
    assert [nk_gemv_config(m).block_n for m in (1, 2, 3, 4)] == [256, 128, 64, 64]


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("m,k,n,x_in_kernel", [
    (1, 4096, 6144, False), (1, 4096, 28672, False), (1, 14336, 4096, False),
    (2, 4096, 4096, False), (4, 8192, 10240, False), (1, 4096, 6144, True),
    (2, 14336, 4096, True)])
def test_lowers_to_triton_for_the_h200(m, k, n, x_in_kernel):
    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    args = [jax.ShapeDtypeStruct(s, d) for s, d in [
        ((m, k), jnp.bfloat16), ((n, k), jnp.int4), ((k // 128, n), jnp.bfloat16),
        ((k // 128, n), jnp.bfloat16)]]
    config = Int4GemvNKConfig(block_n=nk_gemv_config(m).block_n, x_in_kernel=x_in_kernel)
    fn = jax.jit(lambda x, w, s, z: int4_gemv_nk(x, w, s, z, group_size=128, config=config,
                                                 centred_zeros=True))
    with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h200)):
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "int4_gemv_nk" in text


def test_n_major_projections_take_the_gemv_for_a_few_tokens():
    """``linear`` over Int4WeightNK (interpreted kernels): 1-4 tokens through the N-major GEMV,
    more through the Hopper kernel; both within bf16 rounding of the packed weight's XLA
    path."""
    from jaxllm.layers.linear import Int4Weight, int4_n_major, linear

    w = int4_weight(256, 128, 128, jnp.bfloat16, seed=3)
    nk = int4_n_major({"k": Int4Weight(w.qweight, w.scales, w.zeros)})["k"]
    for tokens, gemv in ((1, True), (4, True), (32, False)):
        x = jnp.asarray(np.random.default_rng(tokens).standard_normal((tokens, 256)),
                        jnp.bfloat16)
        run = jax.jit(lambda x: linear(x, nk, int4_backend="pallas_interpret"))
        jaxpr = str(jax.make_jaxpr(run)(x))
        assert ("int4_gemv_nk" in jaxpr) == gemv  # else the Hopper kernel
        if gemv:
            want = int4_matmul_reference(x, w.qweight, w.scales, w.zeros, group_size=128)
            assert_close(run(x), want, x, w, scale_on_output=True)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a GPU")
@pytest.mark.parametrize("m,k,n", [(1, 4096, 6144), (1, 4096, 28672), (1, 14336, 4096),
                                   (2, 4096, 4096), (4, 4096, 6144)])
@pytest.mark.parametrize("splits_sum", ["xla", "last"])
@pytest.mark.parametrize("x_in_kernel", [False, True])
def test_compiled_equals_reference_on_the_gpu(m, k, n, splits_sum, x_in_kernel):
    w = int4_weight(k, n, 128, jnp.bfloat16, seed=m + k)
    x = jnp.asarray(np.random.default_rng(n).standard_normal((m, k)), jnp.bfloat16)
    want = int4_matmul_reference(x, w.qweight, w.scales, w.zeros, group_size=128)
    config = Int4GemvNKConfig(block_n=nk_gemv_config(m).block_n, splits_sum=splits_sum,
                              x_in_kernel=x_in_kernel)
    got = int4_gemv_nk(x, hopper_weight(w.qweight), w.scales, w.zeros, group_size=128,
                       config=config)
    assert_close(got, want, x, w, scale_on_output=True)


def test_gemv_overrides_reach_the_n_major_gemv(monkeypatch):
    """``--gemv-overrides nk.FIELD=...`` (step_profile, step_timeline): the N-major GEMV's pick
    gets them, the packed-word GEMV's stays."""
    from jaxllm.benchmarks.step_profile import override_gemv
    from jaxllm.pallas_kernels.quantized_matmul import gemv, gemv_nk

    monkeypatch.setattr(gemv_nk, "nk_gemv_config", gemv_nk.nk_gemv_config)  # undone after
    monkeypatch.setattr(gemv, "gemv_config", gemv.gemv_config)
    before = gemv.gemv_config(1, 4096, 6144, 128)
    override_gemv("nk.x_in_kernel=True,nk.splits_sum=last")
    picked = gemv_nk.nk_gemv_config(2)
    assert (picked.x_in_kernel, picked.splits_sum, picked.block_n) == (True, "last", 128)
    assert gemv.gemv_config(1, 4096, 6144, 128) == before
    w = int4_weight(256, 64, 64, jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 256)), jnp.float32)
    got = int4_gemv_nk(x, hopper_weight(w.qweight), w.scales, w.zeros, group_size=64,
                       interpret=True)
    want = int4_matmul_reference(x, w.qweight, w.scales, w.zeros, group_size=64)
    assert_close(got, want, x, w, scale_on_output=True)
