"""Runs the tensor- and pipeline-parallel cases (``tests/multidevice/*_cases.py``) in one
process of their own with four forced host devices, so every other test keeps one device (one
process: each costs seconds of imports and its own compiles)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_tensor_parallel_cases_on_four_host_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                        + " --xla_force_host_platform_device_count=4").strip()
    # The cases use no plugin's fixtures or hooks; importing them (schemathesis, hypothesis,
    # anyio, xdist) costs ~2 s of a 2-core machine's CPU at start-up.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         *sorted(glob.glob(os.path.join(HERE, "multidevice", "*_cases.py")))],
        cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
