"""Model configuration: one frozen dataclass for the whole Llama family.

Built from a Hugging Face ``config.json`` (:meth:`ModelConfig.from_hf_config`) or from GGUF
metadata (:meth:`ModelConfig.from_gguf_metadata`). Llama 2, Llama 3/3.1 (llama3 RoPE scaling),
Mistral (sliding window), Qwen2 (q/k/v bias) and SmolLM2 (tied embeddings) differ only in fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxllm.errors import UnsupportedModelError

# HF `architectures` entries we implement, and the GGUF `general.architecture` values.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``rope_type`` "default" means none."""

    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only: wavelengths between these bands are interpolated smoothly.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_scaling type {self.rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor={self.factor} must be > 0")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder-only model."""

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    sliding_window: int | None = None  # Mistral v0.1: attend to the last N positions only
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    # dtype the checkpoint was saved in ("float32", "bfloat16", "float16"); drives dtype="auto".
    checkpoint_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 or None")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Builds a config from the parsed ``config.json`` of a Hugging Face checkpoint."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(hf.get("model_type", ""), "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch or hf.get('model_type')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            num_layers = int(hf["num_hidden_layers"])
            intermediate = int(hf["intermediate_size"])
            vocab = int(hf["vocab_size"])
        except KeyError as e:
            raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; only 'silu'")
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        head_dim = int(hf.get("head_dim") or hidden // heads)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        sliding = hf.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not hf.get("use_sliding_window", False):
            sliding = None
        rope_params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        rope_theta = float(hf.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=_rope_scaling_from_hf(rope_params),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=_normalise_dtype_name(
                hf.get("torch_dtype") or hf.get("dtype") or "float32"),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], *, tied: bool) -> ModelConfig:
        """Builds a config from GGUF key/values (``llama.*``, ``tokenizer.ggml.*``).

        ``tied`` says whether the file lacks an ``output.weight`` tensor (tied embeddings).
        """
        arch = meta.get("general.architecture")
        gguf_archs = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        if arch not in gguf_archs:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} is not supported; supported: {', '.join(gguf_archs)}"
            )
        p = f"{arch}."
        hidden = int(meta[p + "embedding_length"])
        heads = int(meta[p + "attention.head_count"])
        vocab = int(meta.get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"]))
        rope_type = meta.get(p + "rope.scaling.type", "none")
        if rope_type in ("none", None):
            scaling = RopeScaling()
        elif rope_type == "linear":
            scaling = RopeScaling("linear", float(meta[p + "rope.scaling.factor"]))
        else:
            raise UnsupportedModelError(f"GGUF rope scaling type {rope_type!r} is not supported")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=gguf_archs[arch],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(meta[p + "feed_forward_length"]),
            num_hidden_layers=int(meta[p + "block_count"]),
            num_attention_heads=heads,
            num_key_value_heads=int(meta.get(p + "attention.head_count_kv") or heads),
            head_dim=int(meta.get(p + "attention.key_length") or hidden // heads),
            rms_norm_eps=float(meta[p + "attention.layer_norm_rms_epsilon"]),
            rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(meta.get(p + "context_length", 4096)),
            tie_word_embeddings=tied,
            attention_bias=arch == "qwen2",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
            checkpoint_dtype="float32",
        )


def _rope_scaling_from_hf(rope: Mapping[str, Any]) -> RopeScaling:
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "default":
        return RopeScaling()
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    fields = {f.name for f in dataclasses.fields(RopeScaling)}
    kwargs = {k: v for k, v in rope.items() if k in fields and k != "rope_type"}
    return RopeScaling(rope_type=rope_type, **kwargs)


def _normalise_dtype_name(name: str) -> str:
    name = str(name).removeprefix("torch.")
    aliases = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}
    return aliases.get(name, name)
