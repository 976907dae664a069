"""Imports flow one way: serve -> jaxllm -> pallas_kernels; kernels never import the engine."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def imported_packages(package: str) -> set[str]:
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_kernels_do_not_import_the_engine_or_server():
    assert not imported_packages("pallas_kernels") & {"jaxllm", "serve"}


def test_engine_does_not_import_the_server():
    assert "serve" not in imported_packages("jaxllm")


def test_models_reach_kernels_only_through_the_attention_dispatch():
    for path in (ROOT / "jaxllm" / "models").rglob("*.py"):
        assert "pallas_kernels" not in path.read_text(), path
