"""Tokenizers: from a Hugging Face directory, or rebuilt from GGUF metadata without torch.

Both give a ``transformers.PreTrainedTokenizerFast`` (encode, decode, chat template).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from jaxllm.errors import ModelLoadError, UnsupportedModelError

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # silences "PyTorch was not found"

# llama.cpp pre-tokenizer names -> the split regex Hugging Face uses for that model family.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                 r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?"
                r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SUPPORTED_GGUF_PRE_TOKENIZERS = ("gpt2", "smollm", "llama-bpe", "qwen2", "default")

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


def load_hf_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    if not os.path.exists(os.path.join(model_dir, "tokenizer.json")) and not os.path.exists(
            os.path.join(model_dir, "tokenizer_config.json")):
        raise ModelLoadError(f"{model_dir}: no tokenizer.json or tokenizer_config.json found")
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def load_tokenizer(path: str, eos_token_ids: tuple[int, ...] = ()) -> Any:
    """The tokenizer at ``path`` (vLLM's ``--tokenizer``): a Hugging Face directory, a
    ``tokenizer.json`` file or a ``.gguf`` file. A ``tokenizer.json`` carries no special-token
    roles, so its EOS is set to the model's first EOS id that it holds."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        return load_hf_tokenizer(path)
    if path.endswith(".gguf"):
        from jaxllm.loading.gguf_reader import read_gguf

        return tokenizer_from_gguf(read_gguf(path).metadata)
    from transformers import PreTrainedTokenizerFast

    try:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=path)
    except Exception as e:  # tokenizers raises its own exception types for a bad file
        raise ModelLoadError(f"--tokenizer {path}: not a tokenizer.json ({e})") from e
    known = [t for t in eos_token_ids if t < len(tokenizer)]
    if known:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(known[0]))
    return tokenizer


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> Any:
    """Builds the byte-level BPE tokenizer stored in GGUF ``tokenizer.ggml.*`` fields."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            "load the model from a Hugging Face directory instead")
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in SUPPORTED_GGUF_PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_GGUF_PRE_TOKENIZERS)}")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("gpt2", "default"):
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        split = _LLAMA3_SPLIT if pre == "llama-bpe" else _QWEN2_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind_ in zip(tokens, types, strict=True) if kind_ == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind_ in zip(tokens, types, strict=True) if kind_ == _USER_DEFINED])

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    bos = token("bos")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=token("eos"), unk_token=token("unknown"),
        pad_token=token("padding"), chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False)
