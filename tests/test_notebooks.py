"""The notebooks: each runs top to bottom on CPU (nbclient), in a temporary directory, on a
small configuration (SMALL_CONFIGS, injected after its parameters cell).

A cell that raises fails the test, and so does a figure shown without axis labels or a title,
or a result that no longer shows what the notebook is about (SHOWN, run after its last cell).
The fast checks read the notebooks without running them: only the public ``jaxllm`` API is
imported, and no outputs are committed.
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300

# Runs before the notebook's own cells: every plt.show() checks the figures it is showing.
CHECK_FIGURES = r'''
import matplotlib.pyplot as _plt

_show = _plt.show


def _labelled(ax, get):
    siblings = ax.get_shared_x_axes() if get == "get_xlabel" else ax.get_shared_y_axes()
    return any(getattr(a, get)() for a in siblings.get_siblings(ax))


def _checked_show(*args, **kwargs):
    for num in _plt.get_fignums():
        fig = _plt.figure(num)
        suptitle = fig._suptitle.get_text() if fig._suptitle is not None else ""
        for ax in fig.axes:
            if not ax.has_data():
                continue
            missing = [what for what, ok in [
                ("x label", _labelled(ax, "get_xlabel")),
                ("y label", _labelled(ax, "get_ylabel")),
                ("title", ax.get_title() or suptitle)] if not ok]
            if missing:
                raise AssertionError(f"figure {num} has axes without {', '.join(missing)}")
    return _show(*args, **kwargs)


_plt.show = _checked_show
'''

# The shape of benchmarks/kernels.py's JSON, small: lets 04_results plot kernel results even
# before a GPU run has been committed.
KERNELS_JSON = {
    "device": "synthetic (test)", "jax": "0", "ceilings": {"copy_TBps": 4.0, "matmul_TFLOPs": 800},
    "decode": [
        {"batch": b, "context": c, "heads": "llama3_8b", "kv_bytes": 1,
         "pallas": {"us": 1.0, "TBps": 2.0 + c / 8192}, "reference": {"us": 2.0, "TBps": 1.0},
         "jax_triton": "error: not run"}
        for b in (1, 8) for c in (512, 2048)],
    "prefill": [{"chunk": 512, "cached": 0, "GFLOP": 1.0,
                 "pallas_q128_kv64_w8_s3": {"us": 1.0, "tokens_per_s": 1.0, "TFLOPs": 300.0},
                 "reference": {"us": 2.0, "tokens_per_s": 0.5, "TFLOPs": 100.0}}],
}


# The test's small configuration of each notebook, run right after its parameters cell (tagged
# "parameters", as papermill injects parameters): the notebooks keep their defaults for readers.
SMALL_CONFIGS = {
    "01_paged_kv_cache": "MEASURE_NUM_REQUESTS = 6\n",
    # Random prompt ids and fixed lengths: a tiny random-weight model runs the same schedule.
    "02_continuous_batching": """\
import jaxllm

MODEL_CONFIG = jaxllm.ModelConfig(vocab_size=32000, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16)
""",
    # Each distinct generate() program compiles for seconds on the real model, and each call
    # runs its new tokens one by one: one timing batch size, and 8 new tokens (enough for the
    # temperature sweep's log-probabilities to order as SHOWN checks).
    "03_research_generate": "TEMPERATURES = (0.0, 0.6, 1.2)\nSAMPLES_PER_TEMPERATURE = 2\n"
                            "NUM_KEYS = 2\nTIMING_BATCH_SIZES = (1,)\nMAX_NEW_TOKENS = 8\n",
}

# What each notebook shows, checked after its last cell on the small configuration.
SHOWN = {
    "01_paged_kv_cache": """\
assert group_b.metrics.num_cached_tokens >= BLOCK_SIZE  # request 1 reused request 0's blocks
assert 0 < measured < 1 and abs(measured - predicted) < 0.05, (measured, predicted)
""",
    "02_continuous_batching": """\
assert continuous.num_steps < static.num_steps
assert rows["continuous"]["latency"].mean() < rows["static"]["latency"].mean()
preemptions = {m: traces[m].engine.scheduler.num_preemptions for m in traces}
assert preemptions["recompute"] > 0 and preemptions["swap"] > 0, preemptions
assert preemptions["large pool"] == 0, preemptions
assert computed_tokens[0] > needed == computed_tokens[1] == computed_tokens[2]
""",
    "03_research_generate": """\
assert avg_lp[0] > avg_lp[-1]  # hotter samples are less likely under the model
assert abs(score(prompt_ids, [greedy])[0] - float(out.logprobs[0].sum())) < 1e-2
assert same  # a vmapped key gives what a separate call with it gives
""",
}


def code_cells(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    return [cell.source for cell in nb.cells if cell.cell_type == "code"]


def test_notebooks_exist():
    names = [p.stem for p in NOTEBOOKS]
    assert names == ["01_paged_kv_cache", "02_continuous_batching", "03_research_generate",
                     "04_results"]


def public_names() -> set[str]:
    """``jaxllm.__all__``, read without importing jax."""
    tree = ast.parse((ROOT / "jaxllm" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__"
                                                for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("jaxllm/__init__.py has no __all__")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_public_api_only(path):
    source = "\n".join(code_cells(path))
    assert not re.search(r"^\s*(from|import)\s+jaxllm\.", source, re.MULTILINE), (
        f"{path.name} imports a jaxllm submodule")
    assert not re.search(r"^\s*from\s+jaxllm\s+import", source, re.MULTILINE), (
        f"{path.name}: use `import jaxllm` and jaxllm.<name>")
    used = {node.attr for node in ast.walk(ast.parse(source))  # code, not strings or comments
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "jaxllm" and not node.attr.startswith("__")}
    assert used <= public_names(), f"{path.name} uses non-public {used - public_names()}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, (
                f"{path.name}: clear the outputs before committing")


def execute(path: Path, workdir: Path, **env: str) -> None:
    """Runs the notebook on its small configuration, then checks what it shows."""
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    if path.stem in SMALL_CONFIGS:
        params = next(i for i, cell in enumerate(nb.cells)
                      if "parameters" in cell.metadata.get("tags", ()))
        nb.cells.insert(params + 1, nbformat.v4.new_code_cell(SMALL_CONFIGS[path.stem]))
    if path.stem in SHOWN:
        nb.cells.append(nbformat.v4.new_code_cell(SHOWN[path.stem]))
    nb.cells.insert(0, nbformat.v4.new_code_cell(CHECK_FIGURES))
    kernel_env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "JAX_PLATFORMS": "cpu",
    } | env
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute(env=kernel_env)


# Notebooks whose small configuration runs only a tiny random model compile it with XLA's
# CPU optimizations off, as the in-process tiny-model tests do (tests/conftest.py).
TINY_MODEL_ONLY = {"02_continuous_batching"}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    fast_compile = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"} if path.stem in TINY_MODEL_ONLY else {}
    execute(path, tmp_path, **fast_compile)


@pytest.mark.slow
def test_results_notebook_plots_kernel_results(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "kernels.json").write_text(json.dumps(KERNELS_JSON))
    execute(ROOT / "notebooks" / "04_results.ipynb", tmp_path, JAXLLM_RESULTS_DIR=str(results))
