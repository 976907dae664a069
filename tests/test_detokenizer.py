"""IncrementalDetokenizer on the default model's real tokenizer (byte-level BPE)."""

from __future__ import annotations

import random

import pytest

from jaxllm.engine.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer
from jaxllm.engine.request_outputs import RequestOutputProcessor
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

CHINESE = "你好，世界！这是一个测试。我们在流式输出中文文本，每个汉字可能被拆成几个字节。🎉"
MIXED = "The END marker, then STOP here. Café 🎉 over."


@pytest.fixture(scope="module")
def tok():
    from jaxllm.loading import default_model_path
    from jaxllm.loading.gguf_file import GGUFCheckpoint
    from jaxllm.loading.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(GGUFCheckpoint(default_model_path()).metadata)


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.encode("<|im_start|>user\nWrite something.<|im_end|>\n<|im_start|>assistant\n")


def stream(tok, prompt, ids, step=1, flush=True, **params):
    """Feeds ids `step` at a time -> (detokenizer, deltas, stop string)."""
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(**params))
    deltas, stop = [], None
    for start in range(0, len(ids), step):
        delta, stop = detok.update(ids[start:start + step])
        deltas.append(delta)
        if stop:
            break
    if flush and not stop:
        deltas.append(detok.flush())
    return detok, deltas, stop


# ---------------------------------------------------------------------------- decoding


def test_chinese_streams_token_by_token_without_half_characters(tok, prompt):
    ids = tok.encode(CHINESE)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # characters split over tokens
    detok, deltas, _ = stream(tok, prompt, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == CHINESE == detok.output_text
    assert deltas.count("") > 5  # it did wait for the second half of characters


@pytest.mark.parametrize("step", [2, 3, 7])
def test_several_tokens_per_update(tok, prompt, step):
    ids = tok.encode(CHINESE + MIXED)
    _, deltas, _ = stream(tok, prompt, ids, step=step)
    assert "".join(deltas) == CHINESE + MIXED and not any("\ufffd" in d for d in deltas)


def test_random_tokens_stream_to_the_one_shot_decode(tok, prompt):
    rng = random.Random(0)
    ids = [rng.randrange(3, len(tok)) for _ in range(600)]  # arbitrary bytes, invalid UTF-8 too
    detok, deltas, _ = stream(tok, prompt, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == detok.output_text


def test_each_step_decodes_a_short_window(tok, prompt):
    lengths = []

    class Counting:
        def decode(self, ids, **kwargs):
            lengths.append(len(ids))
            return tok.decode(ids, **kwargs)

    ids = tok.encode(CHINESE * 20)
    detok, deltas, _ = stream(Counting(), prompt, ids)
    assert "".join(deltas) == CHINESE * 20 and len(ids) > 1000
    assert max(lengths) <= 8 and len(detok._ids) <= 8  # O(new tokens), not O(output)


def test_bytes_that_never_form_a_character_are_released(tok, prompt):
    lead = tok.convert_tokens_to_ids("ä")  # the lone byte 0xE4: starts a 3-byte character
    ids = [lead] * (MAX_PENDING_TOKENS + 4)
    detok, deltas, _ = stream(tok, prompt, ids, flush=False)
    assert "".join(deltas) == "\ufffd" * MAX_PENDING_TOKENS  # gave up waiting, bounded window
    assert detok.flush() == "\ufffd" * 4 and len(detok._ids) <= MAX_PENDING_TOKENS + 8


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_or_kept(tok, prompt, skip):
    ids = tok.encode("Hello<|im_end|> world<|im_start|><|im_end|> again")
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids
    detok, deltas, _ = stream(tok, prompt, ids, skip_special_tokens=skip)
    expected = ("Hello world again" if skip
                else "Hello<|im_end|> world<|im_start|><|im_end|> again")
    assert "".join(deltas) == expected == detok.output_text


def test_a_run_of_skipped_special_tokens_keeps_the_window_short(tok, prompt):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Hello") + [end] * 40 + tok.encode(" world")
    detok, deltas, _ = stream(tok, prompt, ids, flush=False)
    assert "".join(deltas) == "Hello world" and len(detok._ids) <= 8


def test_a_stop_token_is_left_out_unless_asked_for(tok, prompt):
    ids = tok.encode("Done.") + [tok.convert_tokens_to_ids("Ġyes")]  # a plain stop token id
    for include, expected in [(False, "Done."), (True, "Done. yes")]:
        detok = IncrementalDetokenizer(tok, prompt, SamplingParams(
            include_stop_str_in_output=include, stop_token_ids=(ids[-1],)))
        text = detok.update(ids[:-1])[0] + detok.update(ids[-1:], stop_terminated=True)[0]
        assert text + detok.flush() == expected and detok.num_output_tokens == len(ids)


# --------------------------------------------------------------------------- stop strings


@pytest.mark.parametrize("text, stop", [
    (MIXED, "STOP here"),  # ' STOP' + ' here': spans tokens
    (MIXED, "er, th"),  # starts inside one token, ends inside a later one
    (CHINESE, "界！这是"),  # multibyte characters over 2-3 tokens
    (CHINESE, "🎉"),  # one character, four bytes over several tokens
])
def test_stop_string_across_tokens_is_cut_and_never_shown(tok, prompt, text, stop):
    ids = tok.encode(text)
    index = text.index(stop)
    detok, deltas, found = stream(tok, prompt, ids, stop=["never matches", stop])
    assert found == stop and detok.stop_str == stop
    assert "".join(deltas) == text[:index] == detok.output_text
    shown = ""
    for delta in deltas:  # nothing past the stop string's start was ever shown
        shown += delta
        assert text[:index].startswith(shown)
    assert detok.update(tok.encode(" more")) == ("", None)  # finished: later tokens ignored


def test_include_stop_str_in_output_keeps_it(tok, prompt):
    ids = tok.encode(MIXED)
    detok, deltas, found = stream(tok, prompt, ids, stop=["STOP"],
                                  include_stop_str_in_output=True)
    assert found == "STOP"
    assert "".join(deltas) == MIXED[:MIXED.index("STOP") + 4] == detok.output_text


def test_the_earliest_stop_string_wins(tok, prompt):
    ids = tok.encode(MIXED)
    _, deltas, found = stream(tok, prompt, ids, step=len(ids), stop=["over", "END"])
    assert found == "END" and "".join(deltas) == "The "


def test_held_back_text_that_is_no_stop_string_is_released(tok, prompt):
    ids = tok.encode(MIXED)
    detok, deltas, found = stream(tok, prompt, ids, flush=False, stop=["END marker!", "STOPPED"])
    assert found is None
    # ' END' was held back (it could start 'END marker!') until ' marker,' showed it is not.
    end_at = next(i for i, d in enumerate(deltas) if "END" in d)
    assert deltas[end_at].startswith("END marker")
    assert "".join(deltas) == MIXED == detok.output_text


def test_flush_releases_the_held_tail(tok, prompt):
    ids = tok.encode("Wait for it. STO")
    detok, deltas, found = stream(tok, prompt, ids, flush=False, stop=["STOP"])
    assert found is None and "".join(deltas) == "Wait for it. "
    assert detok.flush() == "STO" and detok.output_text == "Wait for it. STO"
    assert detok.flush() == ""


def test_flush_releases_a_half_character_as_replacement(tok, prompt):
    ids = tok.encode("好")[:-1]  # the character's last byte never comes (length limit)
    detok, deltas, _ = stream(tok, prompt, ids, flush=False)
    assert "".join(deltas) == "" and detok.flush() == tok.decode(ids)


def test_stop_strings_wait_for_min_tokens(tok, prompt):
    ids = tok.encode("a b a b a b")  # 'a', ' b', ' a', ...: one token each
    assert len(ids) == 6
    detok, deltas, found = stream(tok, prompt, ids, stop=["b"], min_tokens=3)
    assert found == "b" and "".join(deltas) == "a b a "  # the first ' b's came too early


# ------------------------------------------------------- the front end's processor
def core_item(ids, finish=None, finished=False, logprob=-0.5):
    """A core output (request_outputs.core_output's layout) of request "r", sample 0."""
    return ("r", None, None, finished, (0.0, 0.0, 0.0, None, 0),
            [(0, ids, [{t: logprob} for t in ids], logprob * len(ids), finish, None, False)])


def test_the_front_end_stops_a_sample_inside_a_delta_and_drops_what_follows(tok, prompt):
    ids = tok.encode(" one two three. four five")
    processor = RequestOutputProcessor(tok)
    processor.add_request("r", None, prompt, SamplingParams(
        stop=[" three"], logprobs=0, output_kind=RequestOutputKind.DELTA))
    (out,), stops = processor.process([core_item(ids)])
    last = next(i for i in range(len(ids)) if " three" in tok.decode(ids[:i + 1]))
    sample = out.outputs[0]
    assert out.finished and stops == [("r", 0, " three")] and not processor.requests
    assert (sample.text, sample.finish_reason, sample.stop_reason) == (" one two", "stop",
                                                                       " three")
    assert sample.token_ids == ids[:last + 1] and len(sample.logprobs) == last + 1
    assert sample.cumulative_logprob == pytest.approx(-0.5 * (last + 1))
    # What the core sampled before it heard of the stop is dropped.
    assert processor.process([core_item(ids[:2], "stop", True)]) == ([], [])


def test_a_final_only_output_is_decoded_token_by_token(tok, prompt):
    ids = tok.encode(MIXED)
    processor = RequestOutputProcessor(tok)
    processor.add_request("r", None, prompt, SamplingParams(
        output_kind=RequestOutputKind.FINAL_ONLY))
    (out,), stops = processor.process([core_item(ids, "length", True)])
    _, deltas, _ = stream(tok, prompt, ids)
    assert out.outputs[0].text == "".join(deltas) == MIXED and not stops
