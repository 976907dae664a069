"""Output kinds (vLLM's ``RequestOutputKind``): DELTA outputs carry only what is new, and put
back together they are exactly the CUMULATIVE output; FINAL_ONLY sends one output per request.
A tiny random model over SmolLM2's tokenizer, sampled with stop strings, n > 1 and logprobs,
with async scheduling (outputs trail the device by up to two steps)."""

from __future__ import annotations

import pytest
from test_engine import make_engine
from test_structured_outputs import tiny_over_smollm2_vocab  # noqa: F401 - a fixture

from jaxllm import RequestOutputKind, SamplingParams
from jaxllm.engine.request_outputs import RequestOutputProcessor

PROMPTS = ["The cat", "Once upon a time", "1, 2, 3,"]


def run(engine, kind: RequestOutputKind) -> dict[str, list]:
    """Every output of every request, in order, keyed by request id."""
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=20, logprobs=2,
                                stop=["e "], output_kind=kind)
        engine.add_request(f"{kind.name}-{i}", prompt, params)
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id.split("-")[1], []).append(out)
    return outputs


def joined(deltas, index):
    outs = [o for d in deltas for o in d.outputs if o.index == index]
    return ("".join(o.text for o in outs), [t for o in outs for t in o.token_ids],
            [e for o in outs for e in o.logprobs], outs[-1].finish_reason)


def whole(output, index):
    out = next(o for o in output.outputs if o.index == index)
    return out.text, out.token_ids, out.logprobs, out.finish_reason


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_delta_outputs_add_up_to_the_cumulative_output(tiny_over_smollm2_vocab,  # noqa: F811
                                                       async_scheduling):
    engine = make_engine(tiny_over_smollm2_vocab, max_model_len=64,
                         async_scheduling=async_scheduling)
    cumulative = run(engine, RequestOutputKind.CUMULATIVE)
    delta = run(engine, RequestOutputKind.DELTA)
    final = run(engine, RequestOutputKind.FINAL_ONLY)
    stopped = 0
    for key, outs in cumulative.items():
        last = outs[-1]
        assert last.finished and len(delta[key]) > 2
        assert [o.finished for o in delta[key]] == [False] * (len(delta[key]) - 1) + [True]
        assert len(final[key]) == 1 and final[key][0].finished
        merged = delta[key][0]
        for d in delta[key][1:]:
            merged = merged.merge(d)
        for index in range(2):
            expected = whole(last, index)
            assert joined(delta[key], index) == expected
            assert whole(merged, index) == expected
            assert whole(final[key][0], index) == expected
            stopped += expected[3] == "stop"
        # Each delta holds only new tokens: together they are the output, once.
        assert sum(len(o.token_ids) for d in delta[key] for o in d.outputs) == sum(
            len(o.token_ids) for o in last.outputs)
    assert stopped  # some samples ended on the stop string
    assert not engine.has_unfinished_requests()


def run_split(engine, kind: RequestOutputKind) -> dict[str, list]:
    """``run``, with the engine as the engine-core process runs it (token deltas out, no
    detokenizing) and a front end's RequestOutputProcessor making the outputs; a stop string
    found there stops its sample in the engine between two steps, as the core's "stop"."""
    processor = RequestOutputProcessor(engine.tokenizer)
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=20, logprobs=2,
                                stop=["e "], output_kind=kind)
        engine.add_request(f"{kind.name}-{i}", prompt, params)
        processor.add_request(f"{kind.name}-{i}", prompt, None, params)
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        outs, stops = processor.process(engine.step())
        engine.stop_sequences(stops)
        for out in outs:
            outputs.setdefault(out.request_id.split("-")[1], []).append(out)
    assert not processor.requests
    return outputs


def test_front_end_detokenizing_gives_the_in_process_engines_outputs(
        tiny_over_smollm2_vocab):  # noqa: F811
    # The same requests in-process and split as jaxllm serve runs them: every output (text,
    # tokens, logprobs, finish and stop reasons) the same, a stop string ending the sample
    # at the same token, and its blocks freed in the engine. In-process outputs of each kind
    # agree with its cumulative ones (the test above): they are the reference for all three.
    in_process = make_engine(tiny_over_smollm2_vocab, max_model_len=64)
    split = make_engine(tiny_over_smollm2_vocab, max_model_len=64)
    split.ship_token_deltas()
    expected = run(in_process, RequestOutputKind.CUMULATIVE)
    got = {kind: run_split(split, kind) for kind in RequestOutputKind}
    for key, outs in expected.items():
        cumulative = [(o.finished, o.outputs) for o in outs]
        assert [(o.finished, o.outputs) for o in got[RequestOutputKind.CUMULATIVE][key]] == \
            cumulative, key
        merged, deltas = [], got[RequestOutputKind.DELTA][key]
        for d in deltas:  # each delta output is the cumulative one's new part
            merged.append(d if not merged else merged[-1].merge(d))
        assert [(o.finished, o.outputs) for o in merged] == cumulative, key
        (final,) = got[RequestOutputKind.FINAL_ONLY][key]
        assert (final.finished, final.outputs) == cumulative[-1], key
    stops = [o.stop_reason for outs in expected.values() for o in outs[-1].outputs]
    assert "e " in stops  # some samples ended on the stop string
    counted = {r: 3 * c for r, c in in_process.stats.finished.items()}
    assert split.stats.finished == counted  # counted as "stop" in both
    assert split.block_manager.usage == 0 and not split.has_unfinished_requests()
