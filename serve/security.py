"""HTTPS and CORS for a public endpoint, with vLLM's flags.

- HTTPS: ``--ssl-keyfile`` / ``--ssl-certfile`` (both or neither), ``--ssl-ca-certs`` and
  ``--ssl-cert-reqs`` (0 none, 1 optional, 2 required: client certificates, as Python's
  ``ssl.VerifyMode``). Checked when the flags are read, before any weight is loaded.
- CORS: off unless ``--allowed-origins`` names origins (a JSON list; ``["*"]`` for any):
  then a browser's preflight (``OPTIONS`` with ``Access-Control-Request-Method``) from an
  allowed origin gets 204 with the allowed methods and headers, and every response to it,
  errors and streams included, carries ``Access-Control-Allow-Origin``. Other origins get
  nothing (the browser then refuses the response), and their preflights 403.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
from collections.abc import Sequence

from aiohttp import web
from jaxllm.serve.errors import APIError

PREFLIGHT_MAX_AGE = 600  # seconds a browser may cache a preflight answer


def json_list(text: str) -> tuple[str, ...]:
    """A flag given as a JSON list of strings (vLLM's ``--allowed-origins '["..."]'``); an
    argparse type, so its errors are argparse's (the message is kept)."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}") \
            from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of non-empty strings, got "
                                         f"{text!r}")
    return tuple(value)


def add_args(group) -> None:
    group.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key")
    group.add_argument("--ssl-certfile", default=None, help="... and this certificate chain")
    group.add_argument("--ssl-ca-certs", default=None,
                       help="CA certificates that client certificates are checked against")
    group.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                       choices=[int(m) for m in ssl.VerifyMode],
                       help="client certificates: 0 not asked, 1 optional, 2 required")
    group.add_argument("--allowed-origins", type=json_list, default=(),
                       metavar="JSON", help='CORS: origins browsers may call from, e.g. '
                       '\'["https://app.example.com"]\' or \'["*"]\' (default: none, CORS off)')
    group.add_argument("--allowed-methods", type=json_list, default=("*",),
                       metavar="JSON", help='CORS: allowed methods (default: ["*"])')
    group.add_argument("--allowed-headers", type=json_list, default=("*",),
                       metavar="JSON", help='CORS: allowed request headers (default: ["*"])')
    group.add_argument("--allow-credentials", action="store_true",
                       help="CORS: let browsers send cookies and HTTP authentication")


def check_tls_files(keyfile: str | None, certfile: str | None, ca_certs: str | None,
                    cert_reqs: int) -> None:
    """ValueError naming the flag when the TLS settings cannot work (the files are loaded
    once here, before any weight is)."""
    if (keyfile is None) != (certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both or neither")
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile),
                       ("--ssl-ca-certs", ca_certs)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag}={path!r}: no such file")
    if keyfile is None and (ca_certs is not None or cert_reqs != ssl.CERT_NONE):
        raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and "
                         "--ssl-certfile (HTTPS)")
    if cert_reqs != ssl.CERT_NONE and ca_certs is None:
        raise ValueError("--ssl-cert-reqs asks for client certificates: give --ssl-ca-certs "
                         "to check them against")
    ssl_context(keyfile, certfile, ca_certs, cert_reqs)  # the files really load


def ssl_context(keyfile: str | None, certfile: str | None, ca_certs: str | None,
                cert_reqs: int) -> ssl.SSLContext | None:
    """The server's TLS context, or None for plain HTTP."""
    if certfile is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile)
        if ca_certs is not None:
            context.load_verify_locations(ca_certs)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"--ssl-certfile/--ssl-keyfile/--ssl-ca-certs: cannot load: {e}") \
            from None
    context.verify_mode = ssl.VerifyMode(cert_reqs)
    return context


class CORS:
    """The CORS policy of ``--allowed-origins`` / ``--allowed-methods`` /
    ``--allowed-headers`` / ``--allow-credentials`` (see the module docstring)."""

    def __init__(self, origins: Sequence[str], methods: Sequence[str] = ("*",),
                 headers: Sequence[str] = ("*",), credentials: bool = False):
        self.origins = frozenset(origins)
        self.any_origin = "*" in self.origins
        self.methods = ", ".join(methods) if "*" not in methods else \
            "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
        self.headers = None if "*" in headers else ", ".join(headers)
        self.credentials = credentials

    @property
    def enabled(self) -> bool:
        return bool(self.origins)

    def allows(self, origin: str | None) -> bool:
        return origin is not None and (self.any_origin or origin in self.origins)

    def _allow_origin(self, response: web.StreamResponse, origin: str) -> None:
        # With credentials a browser refuses "*": name the origin (and say it varies).
        if self.any_origin and not self.credentials:
            response.headers["Access-Control-Allow-Origin"] = "*"
        else:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers.add("Vary", "Origin")
        if self.credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"

    @web.middleware
    async def preflight(self, request: web.Request, handler) -> web.StreamResponse:
        """Answers preflights itself; everything else goes on."""
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in \
                request.headers:
            return await handler(request)
        origin = request.headers.get("Origin")
        if not self.allows(origin):
            raise APIError(f"CORS: origin {origin!r} is not allowed (--allowed-origins)", 403)
        response = web.Response(status=204)
        self._allow_origin(response, origin)
        response.headers["Access-Control-Allow-Methods"] = self.methods
        response.headers["Access-Control-Allow-Headers"] = self.headers or request.headers.get(
            "Access-Control-Request-Headers", "")
        response.headers["Access-Control-Max-Age"] = str(PREFLIGHT_MAX_AGE)
        return response

    async def on_response_prepare(self, request: web.Request,
                                  response: web.StreamResponse) -> None:
        """Runs before any response's headers go out (streams too)."""
        origin = request.headers.get("Origin")
        if self.allows(origin) and "Access-Control-Allow-Origin" not in response.headers:
            self._allow_origin(response, origin)
