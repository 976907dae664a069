"""What XLA runs around the paged-attention kernels: their calls lowered for an H200 from any host
(the Triton lowering runs on CPU; the kernel is one custom call in the pre-optimization
StableHLO), so the padding, slicing and casting the kernels avoid stays avoided."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh
from jaxllm.pallas_kernels.paged_attention import paged_attention_decode, paged_attention_prefill
from jaxllm.pallas_kernels.paged_attention.shapes import HEAD_SHAPES

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")


def lowered_for_h200(fn, num_tokens: int, heads: str = "llama3_8b") -> str:
    """Pre-optimization StableHLO of ``fn`` (a kernel, not interpreted) lowered for an H200 from
    any host: the Triton lowering runs, the kernel is one custom call in the text."""
    h = HEAD_SHAPES[heads]
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    pool = jax.ShapeDtypeStruct((4, 256, 16, h.num_kv_heads, h.head_dim), jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((num_tokens, h.num_q_heads, h.head_dim), jnp.bfloat16), pool,
            pool, i32(), i32(num_tokens, 64), i32(num_tokens), i32(num_tokens + 1),
            i32(num_tokens))
    h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    with jax.sharding.use_abstract_mesh(h200):
        traced = jax.jit(functools.partial(fn, scale=0.1)).trace(*args)
        return traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("num_tokens", [1, 256])
def test_decode_call_has_no_xla_padding_or_float32_output(num_tokens):
    """Llama-3-8B heads (G = 4 in a 16-row tile): q goes to the kernel unpadded; with one split
    (256 tokens) the kernel's output is the result, bf16, only reshaped; with 16 splits (one
    token) the float32 partials hold real rows only and one combine reads them."""
    text = lowered_for_h200(paged_attention_decode, num_tokens)
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "stablehlo.pad" not in text
    assert f"tensor<{num_tokens}x8x16x128" not in text  # no G' = 16 row axis anywhere
    if num_tokens == 256:
        assert "xf32>" not in text and "stablehlo.reduce" not in text
        assert "(tensor<8192x128xbf16>) -> tensor<256x32x128xbf16>" in text  # free reshape
    else:
        assert "tensor<512x128xf32>" in text  # 16 splits x 32 query heads, no padded rows


def test_prefill_call_has_no_xla_padding_for_a_group_of_three():
    """SmolLM2-135M heads (9/3: G = 3, tiles of G' = 4 rows): q and the output stay unpadded."""
    text = lowered_for_h200(paged_attention_prefill, 64, "smollm2_135m")
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "stablehlo.pad" not in text
    assert "(tensor<576x64xbf16>) -> tensor<64x9x64xbf16>" in text  # the result, reshaped


@pytest.mark.parametrize("kernel", [paged_attention_decode, paged_attention_prefill])
def test_calls_plan_their_tokens_without_a_while_loop(kernel):
    """Each token's sequence (and the prefill's blocks' owners) is found by a search unrolled
    into plain ops: an HLO while loop is a thunk XLA's GPU runtime runs from the host, outside
    the step's CUDA graph (it split the 8B step into two and three graphs: RESULTS.md)."""
    text = lowered_for_h200(kernel, 256)
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "stablehlo.while" not in text


@pytest.mark.parametrize(("q_dtype", "pool_dtype", "block_kv"), [
    (jnp.bfloat16, jnp.bfloat16, 128), (jnp.bfloat16, jnp.float8_e4m3fn, 128),
    (jnp.bfloat16, jnp.float32, 64), (jnp.float32, jnp.float32, 64)])
def test_prefill_default_keeps_four_byte_tiles_within_shared_memory(q_dtype, pool_dtype,
                                                                     block_kv):
    """128-key tiles of float32 need more shared memory than an H200 SM has (the config's
    docstring gives Triton's figures); the default halves the key block for them."""
    from jaxllm.pallas_kernels.paged_attention import PrefillConfig

    config = PrefillConfig.for_dtypes(q_dtype, pool_dtype)
    assert config.block_kv == block_kv
    assert config.num_stages == PrefillConfig().num_stages
