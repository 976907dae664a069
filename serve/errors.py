"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

``code`` is the HTTP status as an int and ``type`` an exception-like name, as vLLM sends them
(the ``openai`` client maps the status to its exception classes). Messages never carry object
addresses or tracebacks.
"""

from __future__ import annotations

import json
import re

from aiohttp import web

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}
RETRY_AFTER_SECONDS = 1  # sent with 429 and 503: the queue drains within about a second or two

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class APIError(Exception):
    """An error answered to the client with ``status``; ``param`` names the request field."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, param=param)


def overloaded(message: str, status: int = 429) -> APIError:
    return APIError(message, status, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def sanitize(message: str) -> str:
    """Strips object addresses (``<Foo object at 0x7f...>``) from a message."""
    return _ADDRESS.sub("", message)


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": sanitize(message), "type": ERROR_TYPES.get(status, "Error"),
                      "param": param, "code": status}}


def error_response(error: APIError) -> web.Response:
    return web.Response(status=error.status, headers=error.headers,
                        content_type="application/json",
                        text=json.dumps(error_body(error.message, error.status, error.param)))
