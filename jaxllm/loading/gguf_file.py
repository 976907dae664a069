"""GGUF files (llama.cpp): metadata, dequantized tensors under Hugging Face names.

llama.cpp's converter permutes the rows of q/k projections so that RoPE rotates adjacent
pairs; we undo that so the model keeps the Hugging Face "rotate half" layout.
"""

from __future__ import annotations

import numpy as np

from jaxllm.errors import ModelLoadError, UnsupportedModelError
from jaxllm.model_config import ModelConfig

# Quantization types we dequantize (all have numpy dequantizers in the `gguf` package and
# are what llama-family GGUFs on the hub use). Others fail at load with the list below.
SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


class GGUFCheckpoint:
    """Reads a GGUF file once; ``config``, ``metadata`` and ``get(hf_name)`` (float32)."""

    def __init__(self, path: str):
        import gguf  # imported here: only GGUF users pay for it

        from jaxllm.loading.gguf_reader import read_gguf

        self._gguf = gguf
        try:
            contents = read_gguf(path)
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None
        self.path = path
        self.metadata = contents.metadata
        self._tensors = {}
        for tensor in contents.tensors:
            name = hf_name(tensor.name)
            if name is not None:
                self._tensors[name] = tensor
        self.config = ModelConfig.from_gguf_metadata(
            self.metadata, tied="lm_head.weight" not in self._tensors)
        bad = sorted({t.tensor_type.name for t in self._tensors.values()}
                     - set(SUPPORTED_GGUF_TYPES))
        if bad:
            raise UnsupportedModelError(
                f"{path}: GGUF quantization type(s) {', '.join(bad)} not supported; "
                f"supported: {', '.join(SUPPORTED_GGUF_TYPES)}")

    def names(self) -> set[str]:
        return set(self._tensors)

    def get(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        array = self._gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = np.asarray(array, dtype=np.float32).reshape(tuple(reversed(tensor.shape)))
        cfg = self.config
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            array = _unpermute_rope_rows(array, cfg.num_attention_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            array = _unpermute_rope_rows(array, cfg.num_key_value_heads)
        return array


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation (interleaved pairs -> two halves per head)."""
    if w.ndim == 1:
        return _unpermute_rope_rows(w[:, None], num_heads)[:, 0]
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))
