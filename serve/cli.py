"""``python -m jaxllm.serve [MODEL] [flags]`` (also ``jaxllm serve``): load, serve, drain.

As vLLM's V1 does, the engine steps in its own process (:mod:`jaxllm.engine.core_process`)
and this process serves HTTP; ``--data-parallel-size N`` runs N engine-core processes
(replicas) and balances requests over them; ``--api-server-count N`` > 1 serves from N
front-end processes on one shared listening socket (:mod:`jaxllm.serve.frontends`).
``JAXLLM_ENABLE_MULTIPROCESSING=0`` keeps the engine on a thread of this process instead.
``--nnodes N --node-rank R --headless`` on hosts other than node 0 runs no server: the worker
loop of :mod:`jaxllm.engine.multihost`.
"""

from __future__ import annotations

import logging
import os
import sys

from jaxllm.serve.args import ServerConfig, build_parser, configs_from_args
from jaxllm.serve.server import serve_forever

from jaxllm.engine.async_engine import AsyncLLMEngine
from jaxllm.engine.core_client import EngineCoreClient
from jaxllm.engine.core_process import EngineStartError, launch_engine_cores
from jaxllm.engine.engine_config import EngineConfig
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.errors import JaxLLMError

logger = logging.getLogger("serve")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        engine_config, server_config = configs_from_args(args)
    except ValueError as e:
        parser.error(str(e))  # exits 2, before anything is loaded
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: "
                                                   "%(message)s")
    if server_config.headless:
        return _run_worker_node(engine_config)
    if not server_config.engine_process:
        return _serve_in_process(engine_config, server_config)
    try:
        handles = launch_engine_cores(engine_config, server_config.api_server_count,
                                      server_config.data_parallel_size)
    except EngineStartError as e:
        print(f"jaxllm serve: error: {e}", file=sys.stderr)
        return 1
    # The front ends never compute: they must not take the accelerator the core uses (JAX
    # would claim 75% of its memory on first use).
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_platforms", "cpu")
    if server_config.api_server_count > 1:
        from jaxllm.serve.frontends import run_front_ends

        return run_front_ends(handles, server_config)
    client = EngineCoreClient.for_handles(handles)
    try:
        return serve_forever(client, server_config)
    except OSError as e:  # e.g. the port is taken
        print(f"jaxllm serve: error: {e}", file=sys.stderr)
        return 1
    finally:
        client.shutdown()


def _run_worker_node(engine_config: EngineConfig) -> int:
    """``--headless``: a multi-host worker; replays node 0's steps until it stops (0) or is
    gone (1)."""
    from jaxllm.engine.multihost import run_worker

    try:
        return run_worker(engine_config)
    except (JaxLLMError, ValueError, OSError) as e:
        print(f"jaxllm serve: error: {e}", file=sys.stderr)
        return 1


def _serve_in_process(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    try:
        engine = LLMEngine(engine_config, usage_context="api_server")
    except (JaxLLMError, ValueError, OSError) as e:
        print(f"jaxllm serve: error: {e}", file=sys.stderr)
        return 1
    try:
        return serve_forever(AsyncLLMEngine(engine), server_config)
    except OSError as e:  # e.g. the port is taken
        print(f"jaxllm serve: error: {e}", file=sys.stderr)
        return 1
