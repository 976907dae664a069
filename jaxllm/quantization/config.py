"""Which quantization a model runs with: from ``--quantization`` and from the checkpoint's
``quantization_config`` (config.json), with vLLM's rules, checked before any weight is read.

Implemented: ``int8`` (weight-only, per output channel) and ``fp8`` (W8A8: per-output-channel
weight scales, dynamic per-token activation scales, as vLLM's ``--quantization fp8``), both
quantized at load time from a float checkpoint; 4-bit ``awq`` (AutoAWQ's GEMM layout) and
``gptq`` checkpoints, read as they are packed (:mod:`jaxllm.quantization.int4_checkpoint`); and
FP8 checkpoints in compressed-tensors' ``float-quantized`` format (llm-compressor's FP8_DYNAMIC
scheme: e4m3 weights with per-channel or per-tensor scales, dynamic per-token activations),
read as they are stored. Recognised and refused with a message naming the problem: other
AWQ/GPTQ widths, layouts and options, other compressed-tensors schemes (static activation
scales, weight-only FP8, block or group scales, a quantized KV cache or LM head), and FP8
checkpoints in other formats (``quant_method: fp8``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

QUANTIZATION_METHODS = ("int8", "fp8", "awq", "gptq")
# vLLM's other names for the same weights: the Marlin kernels it serves AWQ and GPTQ
# checkpoints with (it upgrades "awq" to "awq_marlin" itself, so its users' command lines name
# them), and the compressed-tensors format, which names a checkpoint's own quantization (here
# its FP8 W8A8) and quantizes nothing at load time.
VLLM_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}
CHECKPOINT_FORMATS = {"compressed-tensors": "fp8"}
QUANTIZATION_NAMES = (*QUANTIZATION_METHODS, *VLLM_ALIASES, *CHECKPOINT_FORMATS)
IMPLEMENTED = ("int8", "fp8")  # at load time, from float weights
FROM_CHECKPOINT = ("awq", "gptq", "fp8")  # read as stored from a quantized checkpoint
INT4_METHODS = ("awq", "gptq")
FP8_WEIGHT_STRATEGIES = ("channel", "tensor")  # compressed-tensors: one scale per row, or one
AWQ_GROUP_SIZES = (-1, 32, 64, 128)
GPTQ_BITS = (2, 3, 4, 8)
GPTQ_FORMATS = ("gptq", "gptq_v2")  # v1 stores each zero point minus 1; v2 stores it as is


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    method: str  # one of QUANTIZATION_METHODS
    bits: int = 8
    group_size: int = -1  # -1: one group over the whole input dimension
    from_checkpoint: bool = False  # False: quantized at load time from float weights
    # 4-bit checkpoints only: ``zero_offset`` is added to every stored zero point (GPTQ v1: 1);
    # ``symmetric`` (GPTQ sym) ignores the stored zeros for the implied 2^(bits-1), as vLLM's
    # gptq_marlin does (some GPTQ checkpoints label v2 zeros as v1).
    zero_offset: int = 0
    symmetric: bool = False
    modules_to_not_convert: tuple[str, ...] = ()  # AWQ: module names kept in float
    # FP8 checkpoints: "channel" (weight_scale [out, 1]) or "tensor" (weight_scale [1])
    weight_strategy: str = "channel"

    def describe(self) -> str:
        group = "" if self.group_size == -1 else f", group size {self.group_size}"
        source = "checkpoint" if self.from_checkpoint else "quantized at load time"
        return f"{self.method} ({self.bits}-bit{group}, {source})"


def _awq(qc: Mapping[str, Any]) -> QuantizationConfig:
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
    if not qc.get("zero_point", True):
        raise ValueError("AWQ checkpoint with zero_point=false: only AWQ with zero points "
                         "(AutoAWQ's default, the one vLLM serves) is supported")
    kept = tuple(qc.get("modules_to_not_convert") or ())
    return QuantizationConfig("awq", bits, group, True, modules_to_not_convert=kept)


def _gptq(qc: Mapping[str, Any]) -> QuantizationConfig:
    bits, group = int(qc.get("bits", 4)), int(qc.get("group_size", 128))
    if bits not in GPTQ_BITS:
        raise ValueError(f"GPTQ checkpoint with bits={bits}: GPTQ has {GPTQ_BITS}")
    if bits != 4:
        raise ValueError(f"GPTQ checkpoint with bits={bits}: jaxllm reads 4-bit GPTQ only")
    if group != -1 and (group < 1 or group % 8):
        raise ValueError(f"GPTQ checkpoint with group_size={group}: must be -1 or a positive "
                         "multiple of 8 (eight 4-bit values per packed word)")
    fmt = str(qc.get("checkpoint_format") or "gptq").lower()
    if qc.get("is_marlin_format") or fmt not in GPTQ_FORMATS:
        fmt = "marlin" if qc.get("is_marlin_format") else fmt
        raise ValueError(f"GPTQ checkpoint_format {fmt!r}: supported formats are "
                         f"{GPTQ_FORMATS}")
    # desc_act reorders which group each input row belongs to (g_idx); with static groups,
    # or one group over the whole row, the groups stay contiguous.
    if qc.get("desc_act") and not qc.get("static_groups") and group != -1:
        raise ValueError("GPTQ checkpoint with desc_act=true (act-order, non-contiguous "
                         "groups): not supported yet; quantize with desc_act=false or "
                         "static_groups=true")
    if qc.get("lm_head"):
        raise ValueError("GPTQ checkpoint with lm_head=true: a quantized LM head is not "
                         "supported")
    if qc.get("dynamic"):
        raise ValueError("GPTQ checkpoint with per-module 'dynamic' overrides: not supported")
    symmetric = bool(qc.get("sym", True))  # GPTQModel's default when the key is missing
    return QuantizationConfig("gptq", bits, group, True,
                              zero_offset=1 if fmt == "gptq" else 0, symmetric=symmetric)


def _compressed_tensors_fp8(qc: Mapping[str, Any]) -> QuantizationConfig:
    """compressed-tensors' FP8 W8A8 with dynamic per-token activations (what jaxllm's FP8
    layer computes); every other scheme is refused naming its field."""
    name = "compressed-tensors checkpoint"
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise ValueError(f"{name} in format {fmt!r}: only 'float-quantized' (FP8) is "
                         "supported")
    if qc.get("kv_cache_scheme"):
        raise ValueError(f"{name} with a kv_cache_scheme: an FP8 KV cache is not supported")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"{name} with {len(groups)} config_groups: exactly one (every "
                         "decoder projection quantized alike) is supported")
    group = groups[0]
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    if (weights.get("type"), weights.get("num_bits")) != ("float", 8) or \
            not weights.get("symmetric", True):
        raise ValueError(f"{name}: weights {weights}: only symmetric 8-bit float (FP8 e4m3) "
                         "weights are supported")
    strategy = weights.get("strategy")
    if strategy not in FP8_WEIGHT_STRATEGIES:
        raise ValueError(f"{name}: weight strategy {strategy!r}: supported are "
                         f"{FP8_WEIGHT_STRATEGIES}")
    if not acts or (acts.get("type"), acts.get("num_bits")) != ("float", 8) or \
            not acts.get("dynamic") or acts.get("strategy") != "token":
        raise ValueError(f"{name}: input_activations {acts}: only dynamic per-token FP8 "
                         "activations (FP8_DYNAMIC) are supported")
    ignored = qc.get("ignore") or []
    if "lm_head" not in ignored:
        raise ValueError(f"{name}: the LM head is quantized (not in 'ignore'); jaxllm keeps "
                         "it in the compute dtype")
    return QuantizationConfig("fp8", 8, -1, True, weight_strategy=strategy)


# Without a checkpoint (``--load-format dummy``), the 4-bit methods take their quantizers'
# defaults: AutoAWQ's (4 bits, group 128, zero points, GEMM) and GPTQ's (4 bits, group 128,
# symmetric, in order).
# A model whose widths 128 does not divide (SmolLM2's 576) takes the next group size that fits.
DUMMY_INT4_GROUP_SIZES = (128, 64, 32, -1)


def dummy_int4_config(method: str, group_size: int = 128) -> QuantizationConfig:
    """The 4-bit quantization random (dummy) weights are made in, for ``--quantization
    awq|gptq`` with no checkpoint to read it from."""
    if method not in INT4_METHODS:
        raise ValueError(f"--quantization {method}: not a 4-bit method ({INT4_METHODS})")
    return QuantizationConfig(method, 4, group_size, True, symmetric=method == "gptq")


def _checkpoint_method(qc: Mapping[str, Any]) -> QuantizationConfig:
    """Parses a checkpoint's ``quantization_config``; raises ValueError naming what is
    unsupported."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "compressed-tensors":
        return _compressed_tensors_fp8(qc)
    if method == "fp8":
        raise ValueError("FP8 checkpoint with quant_method 'fp8': not supported yet; jaxllm "
                         "reads FP8 checkpoints in compressed-tensors' 'float-quantized' "
                         "format (llm-compressor's FP8_DYNAMIC), or quantizes a float "
                         "checkpoint with --quantization fp8")
    raise ValueError(f"the checkpoint's quantization_config names quant_method {method!r}, "
                     "which jaxllm does not support (supported: "
                     f"{', '.join(QUANTIZATION_METHODS)})")


def quantization_method(name: str | None) -> str | None:
    """The method a ``--quantization`` name stands for (vLLM's aliases mapped; others as
    given, checked by :func:`resolve_quantization`)."""
    return VLLM_ALIASES.get(name) or CHECKPOINT_FORMATS.get(name) or name


def resolve_quantization(requested: str | None,
                         checkpoint_config: Mapping[str, Any] | None) -> QuantizationConfig | None:
    """The quantization to run: the checkpoint's when it has one (``requested`` must then
    agree or be None, as vLLM checks), else ``requested`` applied at load time. ``requested``
    may use vLLM's names (:data:`QUANTIZATION_NAMES`)."""
    flag = f"--quantization {requested}"
    if requested is not None and requested not in QUANTIZATION_NAMES:
        raise ValueError(f"{flag}: must be one of {', '.join(QUANTIZATION_NAMES)}")
    if requested in CHECKPOINT_FORMATS:
        stored = None if checkpoint_config is None else checkpoint_config.get("quant_method")
        if stored != requested:
            found = ("the model has no quantization_config" if stored is None
                     else f"its quantization_config names quant_method {stored!r}")
            raise ValueError(f"{flag}: needs a checkpoint in that format ({found})")
    requested = quantization_method(requested)
    if checkpoint_config is not None:
        config = _checkpoint_method(checkpoint_config)
        if requested is not None and requested != config.method:
            raise ValueError(f"{flag}: the checkpoint is quantized with {config.method}")
    elif requested in INT4_METHODS:
        raise ValueError(f"{flag}: needs a checkpoint quantized with {requested} (its "
                         "quantization_config); a float checkpoint is quantized at load time "
                         "with int8 or fp8")
    elif requested is None:
        return None
    else:
        config = QuantizationConfig(requested)
    runs = config.method in (FROM_CHECKPOINT if config.from_checkpoint else IMPLEMENTED)
    if not runs:
        raise ValueError(f"{config.describe()} is recognised but not implemented yet: jaxllm "
                         f"quantizes with {', '.join(IMPLEMENTED)} (at load time) and reads "
                         f"{', '.join(FROM_CHECKPOINT)} checkpoints")
    return config
