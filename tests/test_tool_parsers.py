"""Tool-call parsers (hermes, llama3_json) on recorded model outputs, whole and streamed.

The streaming checks are property-style: whatever the chunking of an output, the streamed
content and calls add up to what ``extract`` returns for the whole output.
"""

from __future__ import annotations

import json
import random
import re

import pytest
from jaxllm.serve.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    StreamingToolCallParser,
    ToolCall,
    get_tool_parser,
    new_tool_call_id,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}'

# (text, expected content, expected [(name, arguments)])
HERMES_CASES = {
    "single": (f"<tool_call>\n{WEATHER}\n</tool_call>", None,
               [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    "parallel": (f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>", None,
                 [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                  ("get_time", '{"timezone": "Europe/Paris"}')]),
    "content_first": (f"Let me check the weather for you.\n\n<tool_call>\n{WEATHER}\n</tool_call>",
                      "Let me check the weather for you.",
                      [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    "leading_whitespace": (f"\n  Sure <tool>. <tool_call>{TIME}</tool_call>", "\n  Sure <tool>.",
                           [("get_time", '{"timezone": "Europe/Paris"}')]),
    "whitespace_before_call": (f" \n<tool_call>{TIME}</tool_call>\n", None,
                               [("get_time", '{"timezone": "Europe/Paris"}')]),
    "unterminated": (f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n", None,
                     [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                      ("get_time", '{"timezone": "Europe/Paris"}')]),
    "string_arguments": ('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}'
                         "\n</tool_call>", None, [("add", '{"a": 1, "b": 2}')]),
    "unicode": ('<tool_call>{"name": "translate", "arguments": {"text": "Grüße, 世界 🌍"}}'
                "</tool_call>", None, [("translate", '{"text": "Grüße, 世界 🌍"}')]),
    "empty_arguments": ('<tool_call>{"name": "now", "arguments": {}}</tool_call>', None,
                        [("now", "{}")]),
    "text_after_call": (f"<tool_call>{TIME}</tool_call>\nDone.", None,
                        [("get_time", '{"timezone": "Europe/Paris"}')]),
    "plain": ("The capital of France is Paris. Use <b>tags</b> < and <tool", None, []),
    "plain_trailing_space": ("  Hello there  \n", None, []),
    "malformed_json": ('I will call it.<tool_call>\n{"name": "get_weather", "arguments": '
                       '{"city": "Paris"\n</tool_call>', None, []),
    "missing_name": ('<tool_call>{"arguments": {"city": "Paris"}}</tool_call>', None, []),
    "name_not_string": ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', None, []),
    "arguments_not_object": ('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', None,
                             []),
    "unterminated_malformed": ('<tool_call>{"name": "get_weather", "argu', None, []),
}

LLAMA_PARAMS = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_CASES = {
    "single": (LLAMA_PARAMS, None, [("get_weather", '{"city": "Paris"}')]),
    "python_tag": (f"<|python_tag|>{LLAMA_PARAMS}", None, [("get_weather", '{"city": "Paris"}')]),
    "parallel": (f'<|python_tag|> {LLAMA_PARAMS}; {{"name": "get_time", "arguments": '
                 '{"timezone": "UTC"}}\n', None,
                 [("get_weather", '{"city": "Paris"}'), ("get_time", '{"timezone": "UTC"}')]),
    "parallel_no_space": (f"{LLAMA_PARAMS};{LLAMA_PARAMS}", None,
                          [("get_weather", '{"city": "Paris"}')] * 2),
    "leading_whitespace": (f"\n\n{LLAMA_PARAMS}", None, [("get_weather", '{"city": "Paris"}')]),
    "string_arguments": ('{"name": "add", "parameters": "{\\"a\\": 1}"}', None,
                         [("add", '{"a": 1}')]),
    "unicode": ('{"name": "say", "parameters": {"text": "naïve café ☕"}}', None,
                [("say", '{"text": "naïve café ☕"}')]),
    "plain": ("Paris is the capital of France.", None, []),
    "plain_with_braces": ("Here is JSON: {\"a\": 1}", None, []),
    "not_a_call": ('{"foo": 1}', None, []),
    "not_a_call_then_text": ('{"foo": 1} is a JSON object', None, []),
    "text_after_call": (f"{LLAMA_PARAMS} and that is all", None, []),
    "malformed_json": ('{"name": "get_weather", "parameters": {"city": "Par', None, []),
    "missing_name": ('{"parameters": {"city": "Paris"}}', None, []),
    "bad_separator": (f"{LLAMA_PARAMS}, {LLAMA_PARAMS}", None, []),
    "python_tag_then_code": ("<|python_tag|>print('hi')", None, []),
    "python_tag_prefix_only": ("<|python_", None, []),
    "empty": ("", None, []),
}

ALL_CASES = [("hermes", name, *case) for name, case in HERMES_CASES.items()] + [
    ("llama3_json", name, *case) for name, case in LLAMA_CASES.items()]


def expected_content(text, content, calls):
    """Outputs with no valid call come back whole as content."""
    return content if calls else text


@pytest.mark.parametrize("parser_name,case,text,content,calls", ALL_CASES,
                         ids=[f"{p}-{c}" for p, c, *_ in ALL_CASES])
def test_extract(parser_name, case, text, content, calls):
    result = get_tool_parser(parser_name).extract(text)
    assert isinstance(result, ExtractedToolCalls)
    assert result.content == expected_content(text, content, calls)
    assert [(c.name, c.arguments) for c in result.tool_calls] == calls
    for call in result.tool_calls:
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id)
        assert isinstance(json.loads(call.arguments), dict)


def test_parallel_false_keeps_the_first_call():
    for name, text in [("hermes", HERMES_CASES["parallel"][0]),
                       ("llama3_json", LLAMA_CASES["parallel"][0])]:
        result = get_tool_parser(name).extract(text, parallel=False)
        assert [c.name for c in result.tool_calls] == ["get_weather"]
        deltas = StreamingToolCallParser(get_tool_parser(name), parallel=False).feed(text, True)
        assert [d["tool_calls"][0]["function"]["name"] for d in deltas] == ["get_weather"]


def test_tool_call_openai_shape():
    call = ToolCall("f", '{"a": 1}', new_tool_call_id())
    assert call.to_openai() == {"id": call.id, "type": "function",
                                "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert new_tool_call_id() != new_tool_call_id()


def test_unknown_parser_names_the_valid_ones():
    with pytest.raises(ValueError) as error:
        get_tool_parser("nope")
    assert "nope" in str(error.value)
    for name in TOOL_PARSERS:
        assert name in str(error.value)


def stream(parser_name, text, cuts, parallel=True):
    """Feeds text cumulatively, cut at ``cuts``; returns (content, {index: (id, name, args)},
    found_tool_calls) as a client would reassemble them."""
    streaming = get_tool_parser(parser_name).streaming(parallel)
    content, calls = "", {}
    ends = sorted(set(cuts) | {len(text)})
    for end in ends:
        for delta in streaming.feed(text[:end], finished=end == len(text)):
            assert set(delta) in ({"content"}, {"tool_calls"}), delta
            if "content" in delta:
                assert delta["content"]
                content += delta["content"]
            for call in delta.get("tool_calls", []):
                assert call["type"] == "function"
                call_id, name, args = calls.get(call["index"], (call["id"], "", ""))
                assert call["id"] == call_id  # stable within a stream
                calls[call["index"]] = (call_id, name + call["function"]["name"],
                                        args + call["function"]["arguments"])
    assert streaming.feed(text, finished=True) == []  # nothing after the end
    return content, calls, streaming.found_tool_calls


def chunkings(text, seed):
    """Every character, one cut at each position, and random chunk sizes."""
    yield list(range(len(text) + 1))
    for cut in range(len(text) + 1):
        yield [cut]
    rng = random.Random(seed)
    for _ in range(20):
        cuts, end = [], 0
        while end < len(text):
            end += rng.randint(1, 12)
            cuts.append(end)
        yield cuts


@pytest.mark.parametrize("parser_name,case,text,content,calls", ALL_CASES,
                         ids=[f"{p}-{c}" for p, c, *_ in ALL_CASES])
@pytest.mark.parametrize("parallel", [True, False])
def test_streaming_matches_extract(parser_name, case, text, content, calls, parallel):
    whole = get_tool_parser(parser_name).extract(text, parallel)
    for cuts in chunkings(text, seed=f"{parser_name}-{case}-{parallel}"):
        got_content, got_calls, found = stream(parser_name, text, cuts, parallel)
        assert got_content == (whole.content or ""), cuts
        assert sorted(got_calls) == list(range(len(got_calls)))
        assert [(name, args) for _, name, args in got_calls.values()] == \
            [(c.name, c.arguments) for c in whole.tool_calls], cuts
        assert found == bool(whole.tool_calls)


def test_hermes_streams_content_early_and_calls_once_closed():
    streaming = get_tool_parser("hermes").streaming()
    assert streaming.feed("Checking", False) == [{"content": "Checking"}]
    assert streaming.feed("Checking <tool", False) == []  # could be the start tag
    assert streaming.feed("Checking <tools> ", False) == [{"content": " <tools>"}]
    text = f"Checking <tools> \n<tool_call>{TIME}"
    assert streaming.feed(text, False) == []
    [delta] = streaming.feed(text + "</tool_call>", False)
    assert delta["tool_calls"][0]["function"]["name"] == "get_time"
    assert streaming.found_tool_calls
    assert streaming.feed(text + "</tool_call>\n", True) == []


def test_llama3_holds_possible_calls_and_streams_plain_text():
    streaming = get_tool_parser("llama3_json").streaming()
    assert streaming.feed(" ", False) == []
    assert streaming.feed(" <|py", False) == []
    assert streaming.feed(" <|py!", False) == [{"content": " <|py!"}]
    assert streaming.feed(" <|py! ok", False) == [{"content": " ok"}]

    streaming = get_tool_parser("llama3_json").streaming()
    assert streaming.feed('{"foo": ', False) == []
    # A complete object with no name cannot be a call: everything so far is content.
    assert streaming.feed('{"foo": 1}', False) == [{"content": '{"foo": 1}'}]
    assert not streaming.found_tool_calls

    streaming = get_tool_parser("llama3_json").streaming()
    assert streaming.feed(f"{LLAMA_PARAMS}", False) == []
    [delta] = streaming.feed(f"{LLAMA_PARAMS}; {{", False)  # the separator completes call 0
    assert delta["tool_calls"][0]["index"] == 0


def test_malformed_block_after_a_sent_call_stops_the_stream():
    """A call already sent cannot be recalled; the rest of the output is dropped."""
    text = f"<tool_call>{TIME}</tool_call><tool_call>{{bad</tool_call> more"
    assert get_tool_parser("hermes").extract(text).tool_calls == []
    content, calls, found = stream("hermes", text, range(len(text)))
    assert content == "" and [name for _, name, _ in calls.values()] == ["get_time"] and found
