"""AsyncLLMEngine's delivery of outputs, with a stand-in engine (no model): one event-loop
wake-up per step, and a consumer that falls behind gets the newest cumulative output (or the
waiting delta outputs merged into one) instead of a backlog, losing nothing."""

from __future__ import annotations

import asyncio
import threading
import time

from jaxllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from jaxllm.engine.outputs import CompletionOutput, RequestOutput
from jaxllm.engine.sequence import RequestMetrics
from jaxllm.sampling_params import RequestOutputKind, SamplingParams


def cumulative(request_id: str, tokens: list[int], finished: bool) -> RequestOutput:
    text = "".join(f"<{t}>" for t in tokens)
    return RequestOutput(request_id, None, [1], [CompletionOutput(
        0, text, list(tokens), None, None, "length" if finished else None)], finished,
        RequestMetrics(arrival_time=0.0))


async def wait_until(condition, timeout: float = 30.0) -> None:
    """Polls ``condition`` (state the engine thread changes) instead of sleeping a guess."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the engine thread"
        await asyncio.sleep(0.005)


class StandInEngine:
    """Each step adds one token to every request; ``fail_at`` makes that step raise."""

    def __init__(self, num_tokens: int, fail_at: int | None = None, delta: bool = False):
        self.num_tokens, self.fail_at, self.delta = num_tokens, fail_at, delta
        self.requests: dict[str, list[int]] = {}
        self.steps = 0
        self.go = threading.Event()
        self.go.set()

    def add_request(self, request_id, prompt, params, **kwargs):
        self.requests[request_id] = []

    def abort_request(self, request_id):
        self.requests.pop(request_id, None)
        return []

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.go.wait()
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("device fell over")
        outputs = []
        for request_id, tokens in list(self.requests.items()):
            tokens.append(self.steps)
            done = len(tokens) >= self.num_tokens
            outputs.append(cumulative(request_id, tokens[-1:] if self.delta else tokens, done))
            if done:
                del self.requests[request_id]
        return outputs


def test_one_wake_up_per_step_delivers_every_output_in_order():
    class RecordingLoop:
        def __init__(self):
            self.calls = []

        def call_soon_threadsafe(self, fn, *args):
            self.calls.append((fn, args))

    engine = AsyncLLMEngine(StandInEngine(3))
    loop = RecordingLoop()
    queues = {name: asyncio.Queue() for name in "ab"}
    engine._streams = {name: (loop, q) for name, q in queues.items()}
    outputs = [cumulative("a", [1], False), cumulative("b", [1], False),
               cumulative("a", [1, 2], False), cumulative("gone", [1], False)]
    engine._deliver(outputs)
    assert len(loop.calls) == 1  # one self-pipe write for the whole step
    fn, args = loop.calls[0]
    fn(*args)
    assert [queues["a"].get_nowait().outputs[0].token_ids for _ in range(2)] == [[1], [1, 2]]
    assert queues["b"].get_nowait().outputs[0].token_ids == [1]
    assert queues["a"].empty() and queues["b"].empty()


def slow_consumer(delta: bool) -> list[CompletionOutput]:
    """What a client that stalls after its first output receives of a 12-token request (the
    engine runs to the end meanwhile)."""
    stand_in = StandInEngine(num_tokens=12, delta=delta)
    engine = AsyncLLMEngine(stand_in)
    engine.start()
    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.CUMULATIVE

    async def scenario():
        seen = []
        async for out in engine.generate("r", "prompt", SamplingParams(output_kind=kind)):
            seen.append(out.outputs[0])
            if len(seen) == 1:
                await wait_until(lambda: not stand_in.requests)
        return seen

    try:
        return asyncio.run(scenario())
    finally:
        engine.shutdown()


def test_a_consumer_that_falls_behind_gets_the_newest_output_and_loses_nothing():
    seen = [out.token_ids for out in slow_consumer(delta=False)]
    assert seen[-1] == list(range(1, 13))  # every token, in the last (finished) output
    assert len(seen) < 12  # the backlog collapsed into fewer, newer outputs
    assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:], strict=False))  # extends


def test_a_consumer_that_falls_behind_gets_delta_outputs_merged():
    seen = slow_consumer(delta=True)
    assert [t for out in seen for t in out.token_ids] == list(range(1, 13))
    assert "".join(out.text for out in seen) == "".join(f"<{t}>" for t in range(1, 13))
    # However the two threads interleave: fewer outputs than steps, the last one finished.
    assert len(seen) < 12 and seen[-1].finish_reason == "length"
    assert all(out.finish_reason is None for out in seen[:-1])


def test_an_error_behind_waiting_outputs_still_reaches_the_consumer():
    engine = AsyncLLMEngine(StandInEngine(num_tokens=100, fail_at=4))
    engine.start()

    async def scenario():
        seen = []
        try:
            async for out in engine.generate("r", "prompt", None):
                seen.append(out.outputs[0].token_ids)
                # Steps 2, 3 and the failing 4th run meanwhile.
                await wait_until(lambda: engine.dead_error is not None)
        except EngineDeadError as e:
            return seen, e
        return seen, None

    try:
        seen, error = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert error is not None and "device fell over" in str(error)
    assert seen[-1] == [1, 2, 3]  # the newest output before the failure was still delivered
