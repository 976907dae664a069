"""Which source a benchmark ran, recorded in every result JSON, and writing that JSON."""

from __future__ import annotations

import json
import os
import subprocess

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_commit() -> str:
    """``$JAXLLM_COMMIT`` when set (a copied tree whose git metadata lags behind it: set it to
    the commit the tree was copied from), else ``git describe --always --dirty``: a tree that
    differs from its HEAD says so ("-dirty") rather than naming a commit it is not."""
    if os.environ.get("JAXLLM_COMMIT"):
        return os.environ["JAXLLM_COMMIT"]
    proc = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                          capture_output=True, text=True, cwd=_ROOT)
    return proc.stdout.strip() or "unknown"


def write_json(record: dict, path: str | None) -> None:
    """Writes a benchmark's result record to ``path`` (its folder made as needed); None: no
    file."""
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(record, f, indent=2)
