"""Named real-model shapes, shared by tests and benchmarks (``load_format="dummy"``).

``load_model("llama-3-8b", load_format="dummy")`` gives random weights of that shape without
reading any file; numbers are those of the models' published ``config.json``.
"""

from __future__ import annotations

from jaxllm.model_config import ModelConfig, RopeScaling

_LLAMA_7B_BODY = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      head_dim=128, rms_norm_eps=1e-5)

PRESETS: dict[str, ModelConfig] = {
    "llama-2-7b": ModelConfig(
        **_LLAMA_7B_BODY, vocab_size=32000, intermediate_size=11008, num_key_value_heads=32,
        rope_theta=10000.0, max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,),
        checkpoint_dtype="float16"),
    "llama-3-8b": ModelConfig(
        **_LLAMA_7B_BODY, vocab_size=128256, intermediate_size=14336, num_key_value_heads=8,
        rope_theta=500000.0, max_position_embeddings=8192, bos_token_id=128000,
        eos_token_ids=(128001, 128009), checkpoint_dtype="bfloat16"),
    "llama-3.1-8b": ModelConfig(
        **_LLAMA_7B_BODY, vocab_size=128256, intermediate_size=14336, num_key_value_heads=8,
        rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001, 128009),
        checkpoint_dtype="bfloat16"),
    "llama-3-70b": ModelConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, bos_token_id=128000,
        eos_token_ids=(128001, 128009), checkpoint_dtype="bfloat16"),
    "mistral-7b": ModelConfig(
        **_LLAMA_7B_BODY, architecture="MistralForCausalLM", vocab_size=32768,
        intermediate_size=14336, num_key_value_heads=8, rope_theta=1000000.0,
        max_position_embeddings=32768, eos_token_ids=(2,), checkpoint_dtype="bfloat16"),
    "qwen2-7b": ModelConfig(
        architecture="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, attention_bias=True, bos_token_id=None,
        eos_token_ids=(151645, 151643), checkpoint_dtype="bfloat16"),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,), checkpoint_dtype="bfloat16"),
}
