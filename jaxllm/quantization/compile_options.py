"""XLA compile options for a quantized model's forward, per quantization method.

Why: with ``--quantization fp8`` XLA's GEMM autotuner times many cuBLASLt FP8 algorithms for
every GEMM of every step bucket, and the engine's warm-up took more than 4.5 minutes on the
H200 against bf16's ~80 s (RESULTS.md, issue 16). ``xla_gpu_autotune_level`` (0: no GEMM
autotuning, 4: XLA's default, with correctness checks) trades compile time against the GEMMs
picked; ``benchmarks/fp8_compile_time.py`` measures both per level.

The options go to the forward's ``.compile(compiler_options=...)`` (per executable: the other
programs of the process, and other methods, keep XLA's defaults). Override with
``JAXLLM_FP8_AUTOTUNE_LEVEL`` (0-4, or ``xla`` for XLA's own default); an
``xla_gpu_autotune_level`` in ``XLA_FLAGS`` is the user's choice and is left alone.
"""

from __future__ import annotations

import os

from jaxllm.quantization.config import QuantizationConfig

AUTOTUNE_ENV = "JAXLLM_FP8_AUTOTUNE_LEVEL"
# NOTE: level 1 measured on the H200 (benchmarks/fp8_compile_time.py, RESULTS.md "Issue 16:
# the FP8 forward's compile time"): 7-8 s a bucket with cuBLASLt's FP8 GEMMs picked; level 0
# compiles in 5-6 s but falls back to a non-FP8 GEMM 16-20x slower; level 4 timed FP8
# algorithms for minutes a bucket.
FP8_AUTOTUNE_LEVEL: int | None = 1


def forward_compiler_options(quantization: QuantizationConfig | None,
                             environ=os.environ) -> dict[str, int]:
    """The XLA options to compile the forward of a model with this quantization (empty: XLA's
    defaults)."""
    if quantization is None or quantization.method != "fp8":
        return {}
    if "xla_gpu_autotune_level" in environ.get("XLA_FLAGS", ""):
        return {}
    level = FP8_AUTOTUNE_LEVEL
    value = environ.get(AUTOTUNE_ENV, "").strip()
    if value:
        if value == "xla":
            level = None
        elif value.isdigit() and 0 <= int(value) <= 4:
            level = int(value)
        else:
            raise ValueError(f"{AUTOTUNE_ENV}={value!r} must be 0-4 or 'xla'")
    return {} if level is None else {"xla_gpu_autotune_level": level}
