"""Imports flow one way: front ends (serve, benchmarks, the CLI) -> engine -> model -> kernels.

Every folder is imported under the ``jaxllm`` namespace (``jaxllm.serve``, ``jaxllm.benchmarks``,
``jaxllm.pallas_kernels``); nothing imports a generic top-level ``serve`` or ``benchmarks``.
"""

from __future__ import annotations

import ast
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = {"jaxllm": "jaxllm", "jaxllm.serve": "serve", "jaxllm.benchmarks": "benchmarks",
           "jaxllm.pallas_kernels": "pallas_kernels"}
FRONT_ENDS = {"jaxllm.serve", "jaxllm.benchmarks"}


def modules_imported_by(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def imports_of(folder: str, skip: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """{file: modules it imports} for every .py file under ``folder``."""
    return {str(p.relative_to(ROOT)): modules_imported_by(p)
            for p in (ROOT / folder).rglob("*.py") if p.name not in skip
            and "results" not in p.parts}


def offenders(folder: str, forbidden: set[str], skip: tuple[str, ...] = ()) -> list[str]:
    return sorted(f"{path}: {m}" for path, mods in imports_of(folder, skip).items()
                  for m in mods if m.split(".")[0] in forbidden or m in forbidden
                  or any(m == f or m.startswith(f + ".") for f in forbidden))


def test_no_generic_top_level_import_names():
    bare = {"serve", "benchmarks", "pallas_kernels"}
    for folder in FOLDERS.values():
        assert not offenders(folder, bare), offenders(folder, bare)
    assert not offenders("tests", bare), offenders("tests", bare)


def test_kernels_import_nothing_of_the_engine_or_front_ends():
    # Kernels import each other relatively, so they stand alone.
    assert not offenders("pallas_kernels", {"jaxllm"}), offenders("pallas_kernels", {"jaxllm"})


def test_engine_and_model_do_not_import_the_front_ends():
    # The CLI is a front end itself: it hands `jaxllm serve` / `jaxllm bench` on, lazily.
    bad = offenders("jaxllm", FRONT_ENDS, skip=("cli.py",))
    assert not bad, bad


def test_server_and_benchmarks_do_not_import_each_other():
    assert not offenders("serve", {"jaxllm.benchmarks"})
    assert not offenders("benchmarks", {"jaxllm.serve"})


def test_scheduler_side_of_the_engine_imports_no_jax():
    plain = ["block_manager.py", "block_pool.py", "block_swap.py", "block_table.py",
             "scheduler.py", "preemption.py", "scheduler_output.py", "sequence.py",
             "output_processor.py", "detokenizer.py", "stats.py", "request_outputs.py"]
    for name in plain:
        mods = modules_imported_by(ROOT / "jaxllm" / "engine" / name)
        assert not {m for m in mods if m.split(".")[0] in {"jax", "flax"}}, name


def test_structured_outputs_are_host_side_only():
    # Grammars and bitmasks are built on the host; the sampler applies them on the device.
    for path in (ROOT / "jaxllm" / "structured").rglob("*.py"):
        mods = modules_imported_by(path)
        assert not {m for m in mods if m.split(".")[0] in {"jax", "flax"}}, path


def test_models_reach_kernels_only_through_the_attention_dispatch():
    for path in (ROOT / "jaxllm" / "models").rglob("*.py"):
        assert "pallas_kernels" not in path.read_text(), path


def test_pyproject_installs_every_package_under_its_namespace():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == FOLDERS
    on_disk = set()
    for name, folder in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "results" in init.parts:
                continue
            rel = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join((name, *rel)))
    assert set(setuptools["packages"]) == on_disk


def test_entry_points_run_outside_the_repository(tmp_path):
    """From another directory no top-level ``benchmarks`` or ``serve`` can be found, so every
    subcommand must name its module under the jaxllm namespace."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    commands = [["jaxllm.benchmarks", sub, "--help"] for sub in ("throughput", "serve", "latency")]
    commands.append(["jaxllm.serve", "--help"])
    for cmd in commands:
        done = subprocess.run([sys.executable, "-m", *cmd], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (cmd, done.stderr[-2000:])
        assert "usage" in done.stdout.lower(), cmd
