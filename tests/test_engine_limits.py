"""Default sequence and token limits (vLLM's V1 defaults): by platform, device memory and who
builds the engine (the LLM class, the API server, the bare engine); an explicit flag wins."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest
from tiny_models import TINY_CONFIGS

from jaxllm.engine.engine_config import EngineConfig, default_limits, resolve_limits

GIB = 1 << 30
H200, H100, A100, L4 = ((141 * GIB, "NVIDIA H200"), (80 * GIB, "NVIDIA H100 80GB HBM3"),
                        (80 * GIB, "NVIDIA A100-SXM4-80GB"), (22 * GIB, "NVIDIA L4"))


def _limits(device, usage, platform="gpu", **flags):
    config = resolve_limits(EngineConfig(**flags), 8192, platform, *device, usage)
    return config.max_num_seqs, config.max_num_batched_tokens


@pytest.mark.parametrize("device", [H200, H100])
def test_large_gpus_take_1024_sequences_and_8k_or_16k_tokens(device):
    assert _limits(device, "api_server") == (1024, 8192)
    assert _limits(device, "llm_class") == (1024, 16384)
    assert _limits(device, "engine") == (256, 2048)  # the bare engine: vLLM's ENGINE_CONTEXT


@pytest.mark.parametrize("device", [A100, L4, (70 * GIB - 1, "NVIDIA X"), (None, "")])
def test_a100_smaller_and_unknown_gpus_keep_256_and_2048(device):
    for usage in ("api_server", "llm_class", "engine"):
        assert _limits(device, usage) == (256, 2048)
    assert _limits((70 * GIB, "NVIDIA X"), "api_server") == (1024, 8192)  # >= 70 GiB


def test_the_cpu_keeps_32_and_512():
    for usage in ("api_server", "llm_class", "engine"):
        assert _limits((None, "cpu"), usage, platform="cpu") == (32, 512)
        assert _limits(H200, usage, platform="cpu") == (32, 512)


def test_explicit_flags_win(caplog):
    with caplog.at_level(logging.INFO, logger="jaxllm.engine.engine_config"):
        assert _limits(H200, "llm_class", max_num_seqs=256) == (256, 16384)
        assert _limits(H200, "api_server", max_num_batched_tokens=4096) == (1024, 4096)
        # Only the unset one follows the default, capped by the other flag.
        assert _limits(H200, "api_server", max_num_batched_tokens=512) == (512, 512)
        assert _limits(L4, "api_server", max_num_seqs=512, max_num_batched_tokens=4096) \
            == (512, 4096)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == ("max_num_seqs 256, max_num_batched_tokens 16384, max_model_len 8192 "
                        "(max_num_batched_tokens: the defaults for NVIDIA H200 (141.0 GiB), "
                        "llm_class)")
    assert lines[-1] == "max_num_seqs 512, max_num_batched_tokens 4096, max_model_len 8192"
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(2048\) must be >= "
                                         r"max_num_seqs \(4096\)"):
        _limits(L4, "api_server", max_num_seqs=4096)
    with pytest.raises(ValueError, match="usage_context='vllm' must be one of"):
        default_limits("gpu", *H200, "vllm")


def test_llm_and_servers_pass_their_usage_to_the_engine(monkeypatch):
    """The LLM class resolves with ``llm_class`` (a tiny engine, its limits computed as on an
    H200); ``jaxllm serve`` builds its engine, in process or in the engine-core process, with
    ``api_server``."""
    import signal

    import jaxllm.serve.cli as serve_cli

    import jaxllm.engine.engine_core as engine_core
    import jaxllm.engine.llm_engine as llm_engine
    from jaxllm import LLM
    from jaxllm.loading import LoadedModel
    from jaxllm.models.llama import param_shapes

    seen = []

    def as_on_an_h200(config, model_len, platform, memory, name, usage):
        seen.append((platform, usage))
        return resolve_limits(config, model_len, "gpu", *H200, usage)

    monkeypatch.setattr(llm_engine, "resolve_limits", as_on_an_h200)
    cfg = TINY_CONFIGS["qwen2_bias"]
    params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), param_shapes(cfg, jnp.float32))
    model = LoadedModel("tiny", cfg, params, None, jnp.float32)  # never run: zeros will do
    small = dict(max_model_len=64, num_gpu_blocks_override=32, enforce_eager=True,
                 compilation_cache_dir=None, progress=False)
    llm = LLM(model, **small)
    assert (llm.engine.config.max_num_seqs, llm.engine.config.max_num_batched_tokens) \
        == (1024, 16384)
    assert llm.engine.runner.buckets.batch_sizes[-1] == 1024
    assert seen == [("cpu", "llm_class")]

    def fake_engine(config, **kwargs):
        seen.append(kwargs.get("usage_context"))
        raise ValueError("built")  # both callers turn a ValueError into a clean exit

    monkeypatch.setattr(serve_cli, "LLMEngine", fake_engine)
    assert serve_cli._serve_in_process(EngineConfig(), None) == 1
    monkeypatch.setattr(llm_engine, "LLMEngine", fake_engine)
    monkeypatch.setattr(signal, "signal", lambda *args: None)

    class Pipe:
        def send(self, message):
            seen.append(message[0])

    with pytest.raises(SystemExit):
        engine_core.run_engine_core(EngineConfig(), "", [], 0, Pipe(), logging.INFO)
    assert seen[1:] == ["api_server", "api_server", "error"]
