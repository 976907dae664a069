"""The OpenAI-compatible HTTP server (aiohttp). Arrives with the serving issue; imports
flow one way: serve -> jaxllm -> pallas_kernels."""
