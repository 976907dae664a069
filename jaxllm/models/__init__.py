"""Flax model implementations. Every model exposes a pure forward over the paged KV pool."""

from jaxllm.models.llama import LlamaForCausalLM, make_forward, param_shapes

__all__ = ["LlamaForCausalLM", "make_forward", "param_shapes"]
