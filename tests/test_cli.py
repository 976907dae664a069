"""The `jaxllm` command line: a real reply from the default model, the sampling options reaching
generate(), and clean errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

import jaxllm.loading
from jaxllm.cli import main
from jaxllm.generate import GenerateOutput


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
    (["--top-k", "-2"], "--top-k=-2 must be >= 1, or 0 or -1 (off)"),
    (["--min-p", "1.5"], "--min-p=1.5 must be in [0, 1]"),
    (["--repetition-penalty", "0"], "--repetition-penalty=0.0 must be in (0, 2]"),
    (["--presence-penalty", "nan"], "--presence-penalty=nan must be in [-2, 2]"),
    (["--frequency-penalty", "-3"], "--frequency-penalty=-3.0 must be in [-2, 2]"),
    (["--model", "/no/such/dir"], "does not exist"),
])
def test_bad_arguments_give_one_line_errors(argv, message, capsys):
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


class _Tokenizer:
    chat_template, pad_token_id = None, 0

    def __call__(self, text):
        return {"input_ids": [5, 6, 7]}

    def decode(self, ids, skip_special_tokens=False):
        return "reply"


def test_generate_passes_every_sampling_option_and_the_seed(monkeypatch, capsys):
    config = SimpleNamespace(max_position_embeddings=64, eos_token_ids=(2,))
    model = jaxllm.loading.LoadedModel("stub", config, {}, _Tokenizer(), jnp.dtype("float32"))
    seen = {}

    def fake_generate(params, prompt_ids, prompt_lens, key, **kwargs):
        seen.update(kwargs)
        n = kwargs["max_new_tokens"]
        return GenerateOutput(jnp.zeros((1, n), jnp.int32), jnp.full((1,), n, jnp.int32),
                              jnp.zeros((1, n)))

    monkeypatch.setattr(jaxllm.loading, "load_model", lambda *args, **kwargs: model)
    monkeypatch.setattr(sys.modules["jaxllm.generate"], "generate", fake_generate)
    assert main(["generate", "--max-tokens", "3", "--temperature", "0.7", "--top-k", "5",
                 "--top-p", "0.9", "--min-p", "0.1", "--repetition-penalty", "1.2",
                 "--presence-penalty", "0.5", "--frequency-penalty", "-0.5",
                 "--seed", "42"]) == 0
    assert seen == dict(config=config, max_new_tokens=3, temperature=0.7, top_k=5, top_p=0.9,
                        min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5,
                        frequency_penalty=-0.5, seed=42, eos_token_ids=(2,), block_size=16,
                        pad_token_id=0, mesh=None)
    assert capsys.readouterr().out.startswith("reply")
