"""Which quantization a model runs with: from ``--quantization`` and from the checkpoint's
``quantization_config`` (config.json), with vLLM's rules, checked before any weight is read.

Implemented, both quantized at load time from a float checkpoint: ``int8`` (weight-only, per
output channel) and ``fp8`` (W8A8: per-output-channel weight scales, dynamic per-token
activation scales, as vLLM's ``--quantization fp8``). Recognised and refused with a message
saying so: AWQ, GPTQ and FP8 checkpoints (their loaders and kernels are not written yet),
each also checked for the bit widths and group sizes those formats allow, so a malformed
config names its problem.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

QUANTIZATION_METHODS = ("int8", "fp8", "awq", "gptq")
IMPLEMENTED = ("int8", "fp8")  # at load time, from float weights
AWQ_GROUP_SIZES = (-1, 32, 64, 128)
GPTQ_BITS = (2, 3, 4, 8)


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    method: str  # one of QUANTIZATION_METHODS
    bits: int = 8
    group_size: int = -1  # -1: one group over the whole input dimension
    from_checkpoint: bool = False  # False: quantized at load time from float weights

    def describe(self) -> str:
        group = "" if self.group_size == -1 else f", group size {self.group_size}"
        source = "checkpoint" if self.from_checkpoint else "quantized at load time"
        return f"{self.method} ({self.bits}-bit{group}, {source})"


def _checkpoint_method(qc: Mapping[str, Any]) -> QuantizationConfig:
    """Parses a checkpoint's ``quantization_config``; raises ValueError naming what is
    unsupported."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4:
            raise ValueError(f"AWQ checkpoint with bits={bits}: only 4-bit AWQ exists")
        if group not in AWQ_GROUP_SIZES:
            raise ValueError(f"AWQ checkpoint with group_size={group}: supported group sizes "
                             f"are {AWQ_GROUP_SIZES}")
        if version != "gemm":
            raise ValueError(f"AWQ checkpoint version {version!r}: only the GEMM layout is "
                             "supported")
        return QuantizationConfig("awq", bits, group, True)
    if method == "gptq":
        bits, group = int(qc.get("bits", 4)), int(qc.get("group_size", 128))
        if bits not in GPTQ_BITS:
            raise ValueError(f"GPTQ checkpoint with bits={bits}: GPTQ has {GPTQ_BITS}")
        if group != -1 and group < 1:
            raise ValueError(f"GPTQ checkpoint with group_size={group}")
        return QuantizationConfig("gptq", bits, group, True)
    if method in ("fp8", "compressed-tensors"):
        if method == "compressed-tensors":
            fmt = qc.get("format")
            if fmt != "float-quantized":
                raise ValueError(f"compressed-tensors checkpoint in format {fmt!r}: only "
                                 "'float-quantized' (FP8) is supported")
        return QuantizationConfig("fp8", 8, -1, True)
    raise ValueError(f"the checkpoint's quantization_config names quant_method {method!r}, "
                     "which jaxllm does not support (supported: "
                     f"{', '.join(QUANTIZATION_METHODS)})")


def resolve_quantization(requested: str | None,
                         checkpoint_config: Mapping[str, Any] | None) -> QuantizationConfig | None:
    """The quantization to run: the checkpoint's when it has one (``requested`` must then
    agree or be None, as vLLM checks), else ``requested`` applied at load time."""
    flag = f"--quantization {requested}"
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"{flag}: must be one of {', '.join(QUANTIZATION_METHODS)}")
    if checkpoint_config is not None:
        config = _checkpoint_method(checkpoint_config)
        if requested is not None and requested != config.method:
            raise ValueError(f"{flag}: the checkpoint is quantized with {config.method}")
    elif requested in ("awq", "gptq"):
        raise ValueError(f"{flag}: needs a checkpoint quantized with {requested} (its "
                         "quantization_config); a float checkpoint is quantized at load time "
                         "with int8 or fp8")
    elif requested is None:
        return None
    else:
        config = QuantizationConfig(requested)
    if config.method not in IMPLEMENTED or config.from_checkpoint:
        raise ValueError(f"{config.describe()} is recognised but not implemented yet: jaxllm "
                         f"quantizes with {', '.join(IMPLEMENTED)} (at load time)")
    return config
