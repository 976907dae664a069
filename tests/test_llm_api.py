"""The offline LLM API and the async engine on the real SmolLM2 weights."""

from __future__ import annotations

import asyncio
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_engine_idle
from test_server_agents import EMBEDDED, FITS, PARITY

import jaxllm
from jaxllm import LLM, AsyncLLMEngine, EngineDeadError, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(smollm2_llm):
    """The run's shared SmolLM2 engine (conftest), left idle by every test here."""
    yield smollm2_llm
    assert_engine_idle(smollm2_llm.engine)


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_generate_matches_the_jitted_generate_function(llm, smollm2):
    prompts = ["The capital of France is", "def add(a, b):", "从前有一座山，"]
    outs = llm.generate(prompts, greedy(12, ignore_eos=True), use_tqdm=False)
    tok = smollm2.tokenizer
    all_ids = [tok(prompt)["input_ids"] for prompt in prompts]
    padded = np.zeros((len(prompts), 16), np.int32)  # one call: generate() compiles once
    for row, ids in enumerate(all_ids):
        padded[row, :len(ids)] = ids
    ref = jaxllm.generate(smollm2.params, jnp.asarray(padded),
                          jnp.asarray([len(ids) for ids in all_ids]), jax.random.key(0),
                          config=smollm2.config, max_new_tokens=12)
    for row, (prompt, ids, out) in enumerate(zip(prompts, all_ids, outs, strict=True)):
        assert out.outputs[0].token_ids == np.asarray(ref.tokens[row]).tolist()
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
        assert out.prompt == prompt and out.prompt_token_ids == ids


def test_chat_answers_coherently(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   greedy(32), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop" and out.stop_reason is None


def test_stop_strings_tokens_and_lengths(llm):
    counting = "1, 2, 3, 4,"
    out = llm.generate(counting, greedy(30, stop=[" 8"]), use_tqdm=False)[0].outputs[0]
    assert out.text == " 5, 6, 7," and out.stop_reason == " 8" and out.finish_reason == "stop"
    kept = llm.generate(counting, greedy(30, stop=[" 8"], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == " 5, 6, 7, 8"
    comma = llm.get_tokenizer()(",")["input_ids"][0]
    by_id = llm.generate(counting, greedy(30, stop_token_ids=[comma]),
                         use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids[-1] == comma and by_id.stop_reason == comma
    capped = llm.generate(counting, greedy(3), use_tqdm=False)[0].outputs[0]
    assert len(capped.token_ids) == 3 and capped.finish_reason == "length"


def test_min_tokens_holds_back_eos(llm):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    short = llm.chat(chat, greedy(40), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 20
    longer = llm.chat(chat, greedy(40, min_tokens=20), use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= 20


def test_logprobs_hold_the_chosen_token_and_top_k(llm):
    out = llm.generate("The capital of France is", greedy(4, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and len(entry) in (3, 4) and all(v <= 0 for v in entry.values())
        assert entry[token] == max(entry.values())  # greedy picks the most likely
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in
                                                       zip(out.token_ids, out.logprobs,
                                                           strict=True)), abs=1e-4)


def test_parallel_samples_differ_and_seeds_repeat(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    first = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    again = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    texts = [o.text for o in first.outputs]
    assert len(set(texts)) > 1 and texts == [o.text for o in again.outputs]


def test_generate_steps_with_the_start_up_heap_frozen_and_thaws_it(llm, monkeypatch):
    """A full collection during an offline run walks only the run's objects (gc_watch)."""
    import gc

    counts = []
    step = llm.engine.step

    def counted_step():
        counts.append(gc.get_freeze_count())
        return step()

    monkeypatch.setattr(llm.engine, "step", counted_step)
    frozen_before = gc.get_freeze_count()  # CPython 3.12 starts with a few hundred frozen
    llm.generate(["The capital of France is"], greedy(2), use_tqdm=False)
    # the engine's objects too: far more than the interpreter's own
    assert counts and min(counts) > frozen_before + 10_000
    assert gc.get_freeze_count() == 0


def test_bad_input_leaves_nothing_queued(llm):
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate(["fine prompt", [1, 10**9]], greedy(2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_gpu_blocks - 1


def test_async_engine_streams_chinese_cleanly_and_aborts_on_close(llm):
    engine = AsyncLLMEngine(llm.engine)
    engine.start()

    async def scenario():
        deltas, last_text = [], ""
        async for out in engine.generate("a", "请用中文介绍一下北京。", greedy(24)):
            text = out.outputs[0].text
            assert text.startswith(last_text)
            deltas.append(text[len(last_text):])
            last_text = text
        assert all("\ufffd" not in d for d in deltas) and len(deltas) > 1
        stream = engine.generate("b", "Tell me a long story.", greedy(200, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()  # the client went away
        # The abort is applied between two steps: wait for the engine to be idle.
        deadline = time.monotonic() + 60
        while await engine.run_in_engine(lambda e: e.has_unfinished_requests()):
            assert time.monotonic() < deadline, "the aborted request is still running"
            await asyncio.sleep(0.02)
        return last_text

    try:
        text = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert "北京" in text
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_gpu_blocks - 1


def test_a_failing_step_fails_every_request_and_marks_the_engine_dead(smollm2, monkeypatch):
    llm = LLM(smollm2, max_num_seqs=2, max_model_len=128, enforce_eager=True,
              compilation_cache_dir=None, progress=False)
    engine = AsyncLLMEngine(llm.engine)

    def boom(*args, **kwargs):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(llm.engine.runner, "launch_forward", boom)
    engine.start()

    async def scenario():
        async def consume(i):
            async for _ in engine.generate(str(i), "hello", greedy(5)):
                pass

        results = await asyncio.wait_for(
            asyncio.gather(*(consume(i) for i in range(3)), return_exceptions=True), 30)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("late", "hello", greedy(5)):
                pass

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert not engine.is_running


def test_mean_pooling_matches_hugging_face(llm):
    prompts = [{"prompt_token_ids": PARITY[EMBEDDED["names"][i]]["prompt_ids"]} for i in FITS]
    outs = llm.embed(prompts, jaxllm.PoolingParams("MEAN", normalize=False), use_tqdm=False)
    for i, out in zip(FITS, outs, strict=True):
        np.testing.assert_allclose(out.outputs.embedding, EMBEDDED["mean"][i], rtol=1e-3,
                                   atol=2e-3)


def test_llm_shows_engine_logs_only_when_nothing_else_would():
    """The LLM class's INFO lines reach stderr by default in a plain script, not twice once the
    user configures logging, and not at all with JAXLLM_CONFIGURE_LOGGING=0."""
    import subprocess
    import sys

    code = ("import logging, jaxllm.llm as m\n"
            "configured = m.configure_default_logging()\n"
            "package = logging.getLogger('jaxllm')\n"
            "again = m.configure_default_logging()\n"
            "print(configured, len(package.handlers), package.propagate, again)\n"
            "logging.getLogger('jaxllm.engine.llm_engine').info('engine ready in 1.0 s')\n")
    env = {**os.environ}
    env.pop("JAXLLM_CONFIGURE_LOGGING", None)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert run.stdout.split() == ["True", "1", "False", "False"]
    assert "INFO" in run.stderr and "jaxllm.engine.llm_engine: engine ready in 1.0 s" in run.stderr
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**env, "JAXLLM_CONFIGURE_LOGGING": "0"}, check=True)
    assert off.stdout.split()[0] == "False" and "engine ready" not in off.stderr
    configured_first = "import logging\nlogging.basicConfig()\n" + code
    rooted = subprocess.run([sys.executable, "-c", configured_first], capture_output=True,
                            text=True, env=env, check=True)
    assert rooted.stdout.split()[:2] == ["False", "0"]
