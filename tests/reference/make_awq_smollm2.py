"""Writes 4-bit AWQ (AutoAWQ GEMM layout) and GPTQ checkpoints from float weights, with
round-to-nearest quantization and no calibration (no activation-aware scaling, no GPTQ error
feedback): the formats are real, the quantization is the plain baseline both methods improve
on. Numpy and safetensors only, so the tests (main venv) and the fixture script
(``make_quant_fixtures.py``, reference venv) share these packers.

As a script it writes SmolLM2-135M-Instruct (the embedded GGUF model, float32 after its Q4_1
dequantization) as an AWQ checkpoint::

    .venv/bin/python tests/reference/make_awq_smollm2.py OUT_DIR [--group-size 64]

The tests generate it themselves (``tests/test_quant_smollm2.py``); nothing is committed.
SmolLM2-135M's hidden size, 576, is not a multiple of 128 (AWQ's usual group size), so the
default group is 64 (576 = 9 x 64, 1536 = 24 x 64), one of the AutoAWQ group sizes vLLM takes.

Formats (restated in ``/work/shared/reference/formats.md``; K inputs, N outputs, g group):
AWQ ``qweight`` i32[K, N/8] packed along N with nibble i holding column 8c + AWQ_ORDER[i],
``qzeros`` i32[K/g, N/8] the same, ``scales`` f16[K/g, N]; GPTQ ``qweight`` i32[K/8, N]
packed along K in order, ``qzeros`` i32[K/g, N/8] along N in order (v1: zero - 1),
``scales`` f16[K/g, N], ``g_idx`` i32[K].
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
MAX_Q = 15  # 4 bits
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def rtn_int4(w: np.ndarray, group: int, symmetric: bool = False):
    """Round-to-nearest 4-bit of a kernel w [K, N] per group of ``group`` input rows and
    output column. Asymmetric: AutoAWQ's zero-point quantizer (s = max((max - min) / 15,
    1e-5 / 15), z = clamp(-round(min / s), 0, 15)); symmetric: GPTQ's sym (z = 8,
    s = absmax / 7.5). Returns q u8[K, N], scales f16[G, N], zeros u8[G, N]; q is rounded
    against the fp16 scales that are stored."""
    k, n = w.shape
    group = k if group == -1 else group  # -1: one group over all rows
    g = w.astype(np.float32).reshape(k // group, group, n)
    if symmetric:
        scales = np.maximum(np.abs(g).max(axis=1), 1e-5) * 2 / MAX_Q
        zeros = np.full(scales.shape, (MAX_Q + 1) // 2, np.float32)
    else:
        lo, hi = g.min(axis=1), g.max(axis=1)
        scales = np.maximum(hi - lo, 1e-5) / MAX_Q
        zeros = np.clip(-np.round(lo / scales), 0, MAX_Q)
    scales = scales.astype(np.float16)
    q = np.clip(np.round(g / scales.astype(np.float32)[:, None]) + zeros[:, None], 0, MAX_Q)
    return q.reshape(k, n).astype(np.uint8), scales, zeros.astype(np.uint8)


def pack_columns(values: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """u8[R, N] -> i32[R, N/8]: nibble i of word c holds column 8c + order[i]."""
    r, n = values.shape
    cols = values.reshape(r, n // 8, 8).astype(np.uint32)
    words = np.zeros((r, n // 8), np.uint32)
    for i, column in enumerate(order):
        words |= cols[:, :, column] << np.uint32(4 * i)
    return words.view(np.int32)


def pack_rows(values: np.ndarray) -> np.ndarray:
    """u8[K, N] -> i32[K/8, N]: nibble j of word row r holds input row 8r + j."""
    k, n = values.shape
    rows = values.reshape(k // 8, 8, n).astype(np.uint32)
    words = np.zeros((k // 8, n), np.uint32)
    for j in range(8):
        words |= rows[:, j] << np.uint32(4 * j)
    return words.view(np.int32)


def awq_tensors(prefix: str, q, scales, zeros) -> dict[str, np.ndarray]:
    return {prefix + ".qweight": pack_columns(q, AWQ_ORDER),
            prefix + ".qzeros": pack_columns(zeros, AWQ_ORDER), prefix + ".scales": scales}


def gptq_tensors(prefix: str, q, scales, zeros, v1: bool = True) -> dict[str, np.ndarray]:
    """GPTQ tensors; ``v1`` stores each zero minus 1 (wrapping 0 to 15, as AutoGPTQ did)."""
    stored = (zeros.astype(np.int16) - (1 if v1 else 0)) & 0xF
    group = q.shape[0] // scales.shape[0]
    return {prefix + ".qweight": pack_rows(q), prefix + ".scales": scales,
            prefix + ".qzeros": pack_columns(stored.astype(np.uint8)),
            prefix + ".g_idx": (np.arange(q.shape[0]) // group).astype(np.int32)}


def quantization_config(method: str, group: int, symmetric: bool = False) -> dict:
    if method == "awq":  # AutoAWQ's to_transformers_dict()
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
            "sym": symmetric, "static_groups": False, "checkpoint_format": "gptq"}


def quantize_checkpoint(tensors: dict[str, np.ndarray], method: str, group: int,
                        symmetric: bool = False, float_dtype=np.float16) -> dict:
    """HF-named float tensors -> the quantized checkpoint's tensors: every decoder
    projection's ``weight`` [N, K] packed, everything else cast to ``float_dtype``."""
    out = {}
    for name, array in tensors.items():
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix.split(".", 3)[-1] in PROJECTIONS:
            q, scales, zeros = rtn_int4(np.asarray(array, np.float32).T, group, symmetric)
            pack = awq_tensors if method == "awq" else gptq_tensors
            out |= pack(prefix, q, scales, zeros)
        else:
            out[name] = np.asarray(array).astype(float_dtype)
    return out


def write_checkpoint(out_dir: str, hf_config: dict, tensors: dict[str, np.ndarray],
                     method: str, group: int, symmetric: bool = False) -> None:
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    config = hf_config | {"quantization_config": quantization_config(method, group, symmetric),
                          "torch_dtype": "float16"}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              os.path.join(out_dir, "model.safetensors"))


def smollm2_hf_config(config) -> dict:
    """config.json for jaxllm's ModelConfig of SmolLM2 (a Llama)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
            "vocab_size": config.vocab_size, "rms_norm_eps": config.rms_norm_eps,
            "rope_theta": config.rope_theta,
            "max_position_embeddings": config.max_position_embeddings,
            "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu",
            "bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}


def write_smollm2(out_dir: str, method: str = "awq", group: int = 64,
                  symmetric: bool = False) -> str:
    """SmolLM2-135M-Instruct (embedded GGUF) as a 4-bit checkpoint with its tokenizer."""
    from jaxllm.loading import default_model_path
    from jaxllm.loading.gguf_file import GGUFCheckpoint
    from jaxllm.loading.tokenizer import tokenizer_from_gguf
    from jaxllm.model_config import ModelConfig

    gguf = GGUFCheckpoint(default_model_path())
    hf_config = smollm2_hf_config(gguf.config)
    written = dataclasses.replace(ModelConfig.from_hf_config(hf_config),
                                  checkpoint_dtype=gguf.config.checkpoint_dtype)
    assert written == gguf.config, (written, gguf.config)  # the config.json says it all
    tensors = {name: gguf.get(name) for name in sorted(gguf.names())}
    write_checkpoint(out_dir, hf_config, quantize_checkpoint(tensors, method, group, symmetric),
                     method, group, symmetric)
    tokenizer_from_gguf(gguf.metadata).save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--method", choices=("awq", "gptq"), default="awq")
    parser.add_argument("--group-size", type=int, default=64)
    args = parser.parse_args()
    print(write_smollm2(args.out_dir, args.method, args.group_size))


if __name__ == "__main__":
    main()
