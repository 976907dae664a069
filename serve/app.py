"""The aiohttp application: routes, middlewares (HTTP metrics -> error envelope -> CORS
preflight, when enabled -> API key) and background tasks (stats log line, memory monitor)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
from collections.abc import AsyncIterator

from aiohttp import web
from jaxllm.serve import embeddings, generation, routes
from jaxllm.serve.args import ServerConfig
from jaxllm.serve.errors import APIError, error_response
from jaxllm.serve.generation import CLIENT_GONE, STATE, STATUS
from jaxllm.serve.security import CORS
from jaxllm.serve.state import ServerState
from jaxllm.serve.stats import StatsLogger

from jaxllm.engine.engine_client import EngineClient

logger = logging.getLogger("serve")
# No API key needed (serve/openapi.py mirrors this set).
OPEN_PATHS = frozenset({"/health", "/live", "/metrics", "/version", "/openapi.json"})


def build_app(engine: EngineClient, config: ServerConfig) -> web.Application:
    """The app for an engine whose loop is (or will be) started by the caller."""
    state = ServerState(engine, config)
    cors = CORS(config.allowed_origins, config.allowed_methods, config.allowed_headers,
                config.allow_credentials)
    middlewares = [_count_responses, _error_envelope, _require_api_key(config.api_key)]
    if cors.enabled:  # preflights are answered before the API key is asked for
        middlewares.insert(2, cors.preflight)
    app = web.Application(client_max_size=config.max_request_body_bytes,
                          middlewares=middlewares)
    if cors.enabled:
        app.on_response_prepare.append(cors.on_response_prepare)
    app[STATE] = state
    app.router.add_post("/v1/completions", generation.completions)
    app.router.add_post("/v1/chat/completions", generation.chat_completions)
    app.router.add_post("/v1/embeddings", embeddings.embeddings)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/models/{model:.+}", routes.model)
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/live", routes.live)
    app.router.add_get("/version", routes.version)
    app.router.add_get("/metrics", routes.metrics)
    app.router.add_get("/openapi.json", routes.openapi_json)
    app.cleanup_ctx.append(_background_tasks)
    return app


async def _background_tasks(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    tasks = []
    if not state.config.disable_log_stats:
        tasks.append(StatsLogger(state.snapshots, state.config.stats_interval).run())
    if state.memory is not None:
        tasks.append(state.memory.run())
    running = [asyncio.create_task(t) for t in tasks]
    yield
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)


@web.middleware
async def _count_responses(request: web.Request, handler) -> web.StreamResponse:
    """jaxllm:http_requests_total{handler, method, status}; 499 when the client went away."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    status = 500
    try:
        response = await handler(request)
        status = request.get(STATUS, response.status)
        return response
    except asyncio.CancelledError:
        status = CLIENT_GONE
        raise
    finally:
        request.app[STATE].metrics.http.labels(route, request.method, str(status)).inc()


@web.middleware
async def _error_envelope(request: web.Request, handler) -> web.StreamResponse:
    """Every non-2xx answer in OpenAI's shape; unexpected errors become a plain 500."""
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        headers = {k: v for k, v in e.headers.items() if k in ("Allow", "Retry-After")}
        message = e.text if e.text and not e.text.startswith(str(e.status)) else e.reason
        return error_response(APIError(message, e.status, headers=headers))
    except ConnectionError:
        request[STATUS] = CLIENT_GONE
        raise
    except Exception:
        logger.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(APIError("Internal server error.", 500))


def _require_api_key(api_key: str | None):
    """Bearer-token check on everything but OPEN_PATHS (health, liveness, version, metrics,
    the OpenAPI document); the key's SHA-256 is compared in constant time (never the key
    itself, never its length)."""
    digest = hashlib.sha256(api_key.encode()).digest() if api_key else None

    @web.middleware
    async def require_api_key(request: web.Request, handler) -> web.StreamResponse:
        if digest is not None and request.path not in OPEN_PATHS and request.method != "OPTIONS":
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            given = hashlib.sha256(token.strip().encode()).digest()
            if not (hmac.compare_digest(given, digest) & (scheme.lower() == "bearer")):
                raise APIError("Unauthorized: send the API key as 'Authorization: Bearer "
                               "<key>'.", 401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return require_api_key


def log_config(config: ServerConfig) -> str:
    """The server settings for the start-up log, with the API key redacted."""
    fields = dataclasses.asdict(config) | {"api_key": "<redacted>" if config.api_key else None}
    return ", ".join(f"{k}={v}" for k, v in fields.items())
