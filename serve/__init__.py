"""The OpenAI-compatible HTTP server (aiohttp): ``python -m jaxllm.serve`` or ``jaxllm serve``.

Imports flow one way: serve -> jaxllm -> pallas_kernels. Layout: ``args`` (flags and configs),
``app`` (routes, middlewares), ``generation`` (completions and chat), ``protocol`` (request
validation), ``prompts`` (templates, tokenizing, context checks), ``responses`` (bodies and
SSE chunks), ``routes`` (health, models, tokenize, metrics ...), ``metrics`` / ``stats``
(Prometheus, log line, memory monitor), ``state`` (admission, drain bookkeeping), ``server``
(run, signals, drain; ``BackgroundServer`` for tests and notebooks), ``errors``.
"""
