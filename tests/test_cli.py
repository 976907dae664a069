"""The `jaxllm` command line: a real reply from the default model, and clean errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from jaxllm.cli import main


@pytest.mark.slow
def test_generate_prints_a_coherent_answer():
    exe = shutil.which("jaxllm", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "jaxllm"]
    result = subprocess.run(
        cmd + ["generate", "--prompt", "What is the capital of France?", "--max-tokens", "24"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tokens/s" in result.stderr


@pytest.mark.parametrize("argv, message", [
    (["--max-tokens", "0"], "--max-tokens=0 must be >= 1"),
    (["--temperature", "-1"], "--temperature=-1.0 must be >= 0"),
    (["--top-p", "1.5"], "--top-p=1.5 must be in (0, 1]"),
    (["--model", "/no/such/dir"], "does not exist"),
])
def test_bad_arguments_give_one_line_errors(argv, message, capsys):
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
