"""Host and device allocation failures, real where they can be made real: a KV cache or a
swap space larger than any machine fails to allocate at start-up with an error that names
what was being allocated and the setting to change (the server prints it and exits 1, before
serving anything); an allocation failure inside a step fails the requests in flight with
that cause, and the engine stops (the server then exits 1, tests/test_server_faults.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jaxllm.serve.cli import main as serve_main
from test_engine import CFG, make_engine
from tiny_models import random_params

from jaxllm import AsyncLLMEngine, SamplingParams
from jaxllm.engine import llm_engine
from jaxllm.engine.async_engine import EngineDeadError
from jaxllm.errors import OutOfMemoryError
from jaxllm.kv_pool import kv_block_bytes
from jaxllm.loading import LoadedModel

# Bytes no 64-bit machine can map (beyond the 48-bit address space): the allocation fails
# for real, on any host, whatever its overcommit setting.
IMPOSSIBLE_BYTES = 1 << 56


@pytest.fixture(scope="module")
def model():
    return LoadedModel("tiny", CFG, random_params(CFG, seed=21), None, jnp.float32)


def impossible_blocks(block_size: int = 8) -> int:
    return IMPOSSIBLE_BYTES // kv_block_bytes(CFG, block_size, jnp.float32)


def test_a_kv_cache_that_cannot_be_allocated_is_refused_at_start_up(model):
    with pytest.raises(OutOfMemoryError, match=r"out of memory while allocating the KV "
                                               r"cache: RESOURCE_EXHAUSTED.*--gpu-memory-"
                                               r"utilization or --num-gpu-blocks-override"):
        make_engine(model, num_gpu_blocks_override=impossible_blocks())


def test_a_swap_space_the_host_cannot_hold_is_refused_at_start_up(model, monkeypatch):
    # The swap space is capped at what the sequences can use, so no flag reaches an
    # impossible size on a tiny model: the plan is made to ask for one.
    plan = llm_engine.plan_kv_blocks

    def huge_swap(*args, **kwargs):
        return dataclasses.replace(plan(*args, **kwargs), num_cpu_blocks=impossible_blocks())

    monkeypatch.setattr(llm_engine, "plan_kv_blocks", huge_swap)
    with pytest.raises(OutOfMemoryError, match=r"out of memory while allocating the host swap "
                                               r"space: .*To fit, lower --swap-space"):
        make_engine(model)


def test_serve_prints_the_allocation_that_failed_and_exits_1(model, capsys, monkeypatch):
    # The engine in this process, where the stand-in loader applies (through the engine-core
    # process: tests/test_engine_process.py).
    monkeypatch.setenv("JAXLLM_ENABLE_MULTIPROCESSING", "0")
    monkeypatch.setattr(llm_engine, "load_model", lambda *args, **kwargs: model)
    code = serve_main(["smollm2-135m", "--load-format", "dummy", "--enforce-eager",
                       "--num-gpu-blocks-override", str(impossible_blocks(16))])
    err = capsys.readouterr().err
    assert code == 1
    assert "jaxllm serve: error: out of memory while allocating the KV cache" in err, err
    assert "Traceback" not in err


def test_an_allocation_failure_in_a_step_fails_the_requests_in_flight_with_its_cause(model):
    engine = make_engine(model)
    launch = engine.runner.launch_sampler
    calls = {"n": 0}

    def failing_launch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # a few steps in, with both requests running
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB.")
        return launch(*args, **kwargs)

    engine.runner.launch_sampler = failing_launch
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    async_engine = AsyncLLMEngine(engine)

    async def request(i: int) -> str:
        try:
            async for _ in async_engine.generate(str(i), prompt_token_ids=[5, 6, 7 + i],
                                                 params=params):
                pass
        except EngineDeadError as e:
            return str(e)
        return "finished"

    async def scenario():
        return await asyncio.gather(request(0), request(1))

    async_engine.start()
    try:
        results = asyncio.run(scenario())
    finally:
        async_engine.shutdown()
    for message in results:
        assert "out of memory while running a step: RESOURCE_EXHAUSTED" in message, message
        assert "--max-num-batched-tokens" in message
    with pytest.raises(EngineDeadError, match="out of memory while running a step"):
        asyncio.run(async_engine.generate("late", prompt_token_ids=[1, 2],
                                          params=params).__anext__())
