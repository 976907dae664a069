"""The serving engine: block manager and scheduler (plain Python), model runner (JAX),
LLMEngine (one step at a time) and AsyncLLMEngine (a background step loop)."""
