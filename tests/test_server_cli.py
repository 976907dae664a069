"""`jaxllm serve` / `python -m jaxllm.serve` flags (vLLM's spellings onto EngineConfig), start-up
refusals for what jaxllm cannot serve yet, and the memory monitor's leak watch."""

from __future__ import annotations

import logging
import pathlib
import subprocess
import sys

import pytest
from jaxllm.serve.args import ServerConfig, build_parser, configs_from_args
from jaxllm.serve.stats import LeakWatch

from jaxllm.pooling_params import PoolingParams

ROOT = pathlib.Path(__file__).resolve().parent.parent


def configs(*argv, environ=None):
    return configs_from_args(build_parser().parse_args(list(argv)), environ or {})


def test_vllm_flags_map_onto_the_engine_config():
    engine, server = configs(
        "/models/llama", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
        "--max-seq-len", "1024", "--block-size", "32", "--gpu-memory-utilization", "0.5",
        "--swap-space", "2", "--enforce-eager", "--enable-prefix-caching",
        "--scheduling-policy", "priority", "--preemption-mode", "swap", "--seed", "3",
        "--dtype", "bfloat16", "--load-format", "dummy", "--port", "9000",
        "--served-model-name", "a", "b", "--max-queue-len", "5", "--shutdown-timeout", "0")
    assert (engine.model, engine.max_num_seqs, engine.max_num_batched_tokens,
            engine.max_model_len, engine.block_size) == ("/models/llama", 8, 256, 1024, 32)
    assert (engine.gpu_memory_utilization, engine.swap_space, engine.enforce_eager,
            engine.enable_prefix_caching, engine.scheduling_policy, engine.preemption_mode,
            engine.seed, engine.dtype, engine.load_format) == (
        0.5, 2.0, True, True, "priority", "swap", 3, "bfloat16", "dummy")
    assert (server.port, server.served_model_name, server.max_queue_len,
            server.shutdown_timeout, server.host) == (9000, ("a", "b"), 5, 0.0, None)
    defaults, server = configs()
    assert defaults.model is None and server.port == 8000 and server.api_key is None
    assert configs("--max-model-len", "64")[0].max_model_len == 64
    # Unrolled layers: the engine decides by platform unless told either way.
    assert [configs(*flag)[0].unroll_layers for flag in
            ([], ["--unroll-layers"], ["--no-unroll-layers"])] == [None, True, False]
    assert configs("-tp", "2")[0].tensor_parallel_size == 2
    assert configs("-pp", "2", "-tp", "2")[0].pipeline_parallel_size == 2
    assert configs("--tokenizer", "/t/tokenizer.json")[0].tokenizer == "/t/tokenizer.json"
    assert defaults.tokenizer is None
    assert configs("-q", "int8")[0].quantization == "int8"
    assert configs("--quantization", "fp8")[0].quantization == "fp8"
    assert defaults.attention_backend == "auto"
    assert configs("--attention-backend", "pallas_mosaic")[0].attention_backend == \
        "pallas_mosaic"
    assert server.pooler_config == PoolingParams("LAST", normalize=True)
    assert configs("--pooler-config", '{"pooling_type": "mean", "normalize": false}')[1] \
        .pooler_config == PoolingParams("MEAN", normalize=False)


@pytest.mark.parametrize("value, message", [
    ('{"pooling_type": "CLS"}', "pooling_type must be one of LAST, MEAN"),
    ('{"pooling": "MEAN"}', "unknown keys"), ("MEAN", "--pooler-config"),
])
def test_bad_pooler_config_is_refused_by_the_parser(value, message, capsys):
    with pytest.raises(SystemExit):
        configs("--pooler-config", value)
    assert message in capsys.readouterr().err


def test_api_key_and_memory_monitor_come_from_the_environment():
    _, server = configs(environ={"JAXLLM_API_KEY": "k", "JAXLLM_MEMORY_MONITOR": "1"})
    assert server.api_key == "k" and server.memory_monitor
    assert configs("--api-key", "flag", environ={"JAXLLM_API_KEY": "env"})[1].api_key == "flag"


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel-size", "0"], "tensor_parallel_size=0 must be >= 1"),
    (["-pp", "0"], "pipeline_parallel_size=0 must be >= 1"),
    (["--quantization", "bitsandbytes"], "--quantization=bitsandbytes is not supported"),
    (["/models/llama", "-q", "gguf"], "--quantization=gguf is not supported"),
    (["a", "--model", "b"], "two models given"),
])
def test_unsupported_values_fail_before_loading(argv, message):
    with pytest.raises(ValueError, match=message):
        configs(*argv)
    assert configs("-q", "gguf")[0].model is None  # the default model is a GGUF file
    for name in ("awq_marlin", "gptq_marlin", "compressed-tensors"):  # vLLM's names
        assert configs("/models/llama", "-q", name)[0].quantization == name


@pytest.mark.parametrize("field, value", [("port", 70000), ("max_queue_len", 0),
                                          ("shutdown_timeout", -1), ("api_key", ""),
                                          ("max_request_body_bytes", 10)])
def test_server_config_validates(field, value):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**{field: value})


def test_jaxllm_serve_hands_over_to_python_m_serve():
    result = subprocess.run([sys.executable, "-m", "jaxllm", "serve", "-tp", "4"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    # Refused before any weight is read: this machine has one device.
    assert result.returncode == 1
    assert "--tensor-parallel-size 4: must be between 1 and the number of visible devices" \
        in result.stderr
    assert "Traceback" not in result.stderr
    help_text = subprocess.run([sys.executable, "-m", "jaxllm", "serve", "--help"], cwd=ROOT,
                               capture_output=True, text=True, timeout=120).stdout
    for flag in ("--max-num-seqs", "--max-model-len", "--api-key", "--max-queue-len",
                 "--shutdown-timeout", "--served-model-name", "--enable-prefix-caching"):
        assert flag in help_text


def test_leak_watch_flags_steady_growth_only(caplog):
    mib = 1 << 20
    watch = LeakWatch("host RSS", window=6, min_growth=10 * mib)
    with caplog.at_level(logging.WARNING, logger="serve.stats"):
        assert not any(watch.add(500 * mib + (i % 2) * 30 * mib) for i in range(12))  # noisy
        flat = LeakWatch("device memory", window=6, min_growth=10 * mib)
        assert not any(flat.add(500 * mib + i * mib) for i in range(12))  # grows, but little
        growing = LeakWatch("host RSS", window=6, min_growth=10 * mib)
        flags = [growing.add(600 * mib + i * 5 * mib) for i in range(12)]
    assert flags == [False] * 5 + [True] + [False] * 5 + [True]  # once per window
    assert "host RSS grew steadily" in caplog.text
