"""4-bit (AWQ / GPTQ) weight matmul: ``x @ dequantize(qweight, scales, zeros)``.

:func:`int4_gemv` (1-16 tokens: FMAs, each packed word read once) and :func:`int4_matmul`
(more tokens: tensor-core dots over tiles) are Pallas kernels for the Triton GPU backend that
dequantize in registers (pass ``interpret=True`` to run them on CPU);
:func:`int4_matmul_reference`, with the same signature, dequantizes the whole weight in XLA and
is the spec; :func:`int4_matmul_xla_int4` is the same product for many tokens through XLA's own
int4 GEMM (no bf16 copy of the weight); :func:`int4_matmul_hopper` (hopper.py) is a Mosaic GPU
kernel for Hopper with the weight as wgmma's register operand (timed alone on the H200; the
engine's for 17-512 tokens on a Hopper GPU by default, ``JAXLLM_INT4_HOPPER=auto``), and
:func:`int4_gemv_nk` (gemv_nk.py) the GEMV over that N-major weight for 1-4 tokens beside it.
:func:`~.gemv.int4_gemv_prescaled` is the GEMV over an x another kernel pre-scaled: the RMSNorm
(with the residual add) or the decode attention's split merge (gemv_prescale.py).
:func:`gemv_unsupported` and :func:`unsupported` say why a shape cannot go through the Triton
kernels (callers then use the reference).
"""

from .gemv import Int4GemvConfig, gemv_config, gemv_unsupported, int4_gemv
from .gemv_nk import Int4GemvNKConfig, int4_gemv_nk, nk_gemv_unsupported
from .hopper import HopperInt4Config, int4_matmul_hopper
from .kernel import Int4MatmulConfig, int4_matmul, unsupported
from .reference import PER_WORD, dequantize_int4, int4_matmul_reference
from .xla_int4 import int4_matmul_xla_int4

__all__ = ["PER_WORD", "HopperInt4Config", "Int4GemvConfig", "Int4GemvNKConfig",
           "Int4MatmulConfig", "dequantize_int4", "gemv_config", "gemv_unsupported",
           "int4_gemv", "int4_gemv_nk", "int4_matmul", "int4_matmul_hopper",
           "int4_matmul_reference", "int4_matmul_xla_int4", "nk_gemv_unsupported",
           "unsupported"]
