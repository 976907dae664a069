"""The XLA options a quantized forward is compiled with (jaxllm/quantization/compile_options.py):
only FP8 gets any, the environment overrides the default, and XLA_FLAGS wins over both."""

from __future__ import annotations

import pytest

from jaxllm.quantization import QuantizationConfig
from jaxllm.quantization import compile_options as co


def test_only_fp8_forward_gets_the_autotune_level(monkeypatch):
    fp8, awq = QuantizationConfig("fp8"), QuantizationConfig("awq", bits=4, group_size=128)
    assert co.forward_compiler_options(None, {}) == {}
    assert co.forward_compiler_options(awq, {co.AUTOTUNE_ENV: "0"}) == {}
    monkeypatch.setattr(co, "FP8_AUTOTUNE_LEVEL", 1)  # a measured default, once chosen
    assert co.forward_compiler_options(fp8, {}) == {"xla_gpu_autotune_level": 1}
    assert co.forward_compiler_options(fp8, {co.AUTOTUNE_ENV: "0"}) == {
        "xla_gpu_autotune_level": 0}
    assert co.forward_compiler_options(fp8, {co.AUTOTUNE_ENV: "xla"}) == {}
    assert co.forward_compiler_options(
        fp8, {"XLA_FLAGS": "--xla_gpu_autotune_level=4", co.AUTOTUNE_ENV: "0"}) == {}
    with pytest.raises(ValueError, match=co.AUTOTUNE_ENV):
        co.forward_compiler_options(fp8, {co.AUTOTUNE_ENV: "fast"})
