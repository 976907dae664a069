"""4-bit (AWQ / GPTQ) weight matmul: ``x @ dequantize(qweight, scales, zeros)``.

:func:`int4_matmul` is a Pallas kernel for the Triton GPU backend that dequantizes in
registers (pass ``interpret=True`` to run it on CPU); :func:`int4_matmul_reference`, with the
same signature, dequantizes the whole weight in XLA and is the spec. :func:`unsupported` says
why a shape cannot go through the kernel (callers then use the reference).
"""

from .kernel import Int4MatmulConfig, int4_matmul, unsupported
from .reference import PER_WORD, dequantize_int4, int4_matmul_reference

__all__ = ["PER_WORD", "Int4MatmulConfig", "dequantize_int4", "int4_matmul",
           "int4_matmul_reference", "unsupported"]
