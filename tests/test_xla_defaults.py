"""jaxllm's XLA defaults (jaxllm/xla_defaults.py): added only with a CUDA plugin, never over
the user's own setting of the same flag, and not at all with JAXLLM_XLA_DEFAULTS=0."""

from __future__ import annotations

from jaxllm import xla_defaults


def test_pallas_calls_join_command_buffers_only_on_cuda_and_never_over_the_user():
    flag = "--legacy_command_buffer_custom_call_targets=__gpu$xla.gpu.triton"
    env = {"XLA_FLAGS": "--xla_gpu_autotune_level=1"}
    xla_defaults.apply(env, has_cuda=lambda: True)
    assert env["XLA_FLAGS"] == f"--xla_gpu_autotune_level=1 {flag}"
    xla_defaults.apply(env, has_cuda=lambda: True)  # idempotent
    assert env["XLA_FLAGS"].count("legacy_command_buffer") == 1
    own = {"XLA_FLAGS": "--legacy_command_buffer_custom_call_targets="}
    xla_defaults.apply(own, has_cuda=lambda: True)
    assert own["XLA_FLAGS"] == "--legacy_command_buffer_custom_call_targets="
    cpu, off = {}, {"JAXLLM_XLA_DEFAULTS": "0"}
    xla_defaults.apply(cpu, has_cuda=lambda: False)  # the CPU jaxlib refuses the flag
    xla_defaults.apply(off, has_cuda=lambda: True)
    assert "XLA_FLAGS" not in cpu and "XLA_FLAGS" not in off
