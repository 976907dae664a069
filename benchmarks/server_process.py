"""``jaxllm serve`` in its own process, for the benchmarks that load a live server (the soak,
the schema fuzzing): benchmarks never import the server."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, flags: list[str], *, stdout=None,
                 timeout: float = 600.0) -> subprocess.Popen:
    """``python -m jaxllm.serve --host 127.0.0.1 --port PORT FLAGS``; returns once it answers
    /health. Raises RuntimeError when it exits first or is not healthy within ``timeout``
    seconds (then it is killed)."""
    proc = subprocess.Popen([sys.executable, "-m", "jaxllm.serve", "--host", "127.0.0.1",
                             "--port", str(port), *flags], stdout=stdout,
                            stderr=subprocess.STDOUT if stdout is not None else None)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:  # not listening yet
            time.sleep(0.5)
    code = proc.poll()
    proc.kill()
    raise RuntimeError(f"jaxllm serve did not become healthy within {timeout:g} s (exit code "
                       f"{code})")
