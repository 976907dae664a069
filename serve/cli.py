"""``python -m jaxllm.serve [MODEL] [flags]`` (also ``jaxllm serve``): load, serve, drain."""

from __future__ import annotations

import logging
import sys

from jaxllm.serve.args import build_parser, configs_from_args
from jaxllm.serve.server import serve_forever

from jaxllm.engine.async_engine import AsyncLLMEngine
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
    try:
        engine = LLMEngine(engine_config)
    except (JaxLLMError, ValueError, OSError) as e:
        print(f"jaxllm serve: error: {e}", file=sys.stderr)
        return 1
    try:
        return serve_forever(AsyncLLMEngine(engine), server_config)
    except OSError as e:  # e.g. the port is taken
        print(f"jaxllm serve: error: {e}", file=sys.stderr)
        return 1
