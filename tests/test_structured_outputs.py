"""Structured outputs: every constrained output parses and validates, whatever the seed, with
n > 1, preemption, async scheduling and stop strings; unconstrained rows in the same batch get
exactly the tokens they get alone; bad constraints are refused before anything is queued.

The engine cases run a tiny random model over SmolLM2's tokenizer (random weights are the
hardest case for a grammar: nothing but the mask keeps them on track); the real SmolLM2
engine is sampled at temperature 1 over a set of schemas.
"""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from conftest import assert_engine_idle
from test_engine import make_engine
from tiny_models import TINY, random_params

from jaxllm import ModelConfig, SamplingParams
from jaxllm.loading import LoadedModel
from jaxllm.sampler_rows import build_sampling_metadata
from jaxllm.sampling import sample, unpack_bitmask
from jaxllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from jaxllm.structured import GrammarCompiler, StructuredOutputs

# Nested objects, arrays, enums, bounded numbers, required fields; short enough to finish
# well inside max_tokens even from a random model.
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "day": {"enum": ["mon", "tue", "wed"]},
        "temps": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "number", "minimum": -40, "maximum": 50}}},
     "required": ["day", "temps"], "additionalProperties": False},
    {"type": "object", "properties": {
        "order": {"type": "object", "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
            "express": {"type": "boolean"}},
            "required": ["id", "express"], "additionalProperties": False}},
     "required": ["order"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def tiny_over_smollm2_vocab(smollm2_header):
    """A 2-layer random model with SmolLM2's vocabulary and tokenizer."""
    real, tokenizer = smollm2_header
    cfg = ModelConfig(**TINY | {"vocab_size": real.vocab_size},
                      eos_token_ids=real.eos_token_ids)
    return LoadedModel("tiny-smollm2-vocab", cfg, random_params(cfg, seed=3), tokenizer,
                       jnp.float32)


def run(engine, requests):
    """requests: [(prompt, SamplingParams)] -> finished RequestOutputs in order."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)] for i in range(len(requests))]


def json_params(schema, seed, **kw):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=kw.pop("max_tokens", 80),
                          structured_outputs=StructuredOutputsParams(json=schema), **kw)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_random_model_output_always_validates(tiny_over_smollm2_vocab, async_scheduling):
    """n = 2 forks and a pool small enough to preempt: every sample is valid JSON."""
    engine = make_engine(tiny_over_smollm2_vocab, async_scheduling=async_scheduling,
                         num_gpu_blocks_override=20, max_model_len=96, max_num_seqs=6)
    requests = [(f"Record {i}:", json_params(SCHEMAS[i % 3], seed=i, n=2)) for i in range(6)]
    outs = run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for (_, params), out in zip(requests, outs, strict=True):
        schema = json.loads(params.structured_outputs.json)
        assert len(out.outputs) == 2
        for completion in out.outputs:
            assert completion.finish_reason == "stop", completion
            jsonschema.validate(json.loads(completion.text), schema)
    assert engine.structured.num_matchers == 0
    assert_engine_idle(engine)


def test_regex_choice_grammar_and_stop_strings(tiny_over_smollm2_vocab):
    engine = make_engine(tiny_over_smollm2_vocab)
    spec = lambda **kw: StructuredOutputsParams(**kw)
    lark = 'start: "yes" | "no" " because " /[a-z]{1,6}/'
    requests = [
        ("Phone:", SamplingParams(seed=1, max_tokens=30,
                                  structured_outputs=spec(regex=r"\d{3}-\d{4}"))),
        ("Pick:", SamplingParams(seed=2, max_tokens=30,
                                 structured_outputs=spec(choice=["red", "green", "blue"]))),
        ("Answer:", SamplingParams(seed=3, max_tokens=30, structured_outputs=spec(grammar=lark))),
        # A stop string cuts constrained output like any other.
        ("Count:", SamplingParams(seed=4, max_tokens=30, stop=["-"],
                                  structured_outputs=spec(regex=r"\d{3}-\d{4}"))),
    ]
    phone, color, answer, cut = (o.outputs[0] for o in run(engine, requests))
    assert re.fullmatch(r"\d{3}-\d{4}", phone.text), phone.text
    assert color.text in ("red", "green", "blue")
    assert re.fullmatch(r"yes|no because [a-z]{1,6}", answer.text), answer.text
    assert re.fullmatch(r"\d{3}", cut.text) and cut.stop_reason == "-", cut
    assert_engine_idle(engine)


def test_unconstrained_rows_get_the_tokens_they_get_alone(tiny_over_smollm2_vocab):
    prompts = ["Once upon a time", "The weather today", "def main():"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = run(make_engine(tiny_over_smollm2_vocab), [(p, greedy) for p in prompts])
    mixed = run(make_engine(tiny_over_smollm2_vocab),
                [(p, greedy) for p in prompts] + [(f"JSON {i}:", json_params(s, seed=i))
                                                  for i, s in enumerate(SCHEMAS)])
    assert [o.outputs[0].token_ids for o in mixed[:3]] == \
        [o.outputs[0].token_ids for o in alone]
    for out, schema in zip(mixed[3:], SCHEMAS, strict=True):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_async_grammar_completion_matches_sync(tiny_over_smollm2_vocab):
    """With async scheduling the grammars take a step's tokens on the bitmask thread and a
    complete grammar stops its sequence only when the next sampler launches (the sequence may
    be scheduled once more meanwhile): the outputs, streamed (DELTA) or whole, and the finish
    reasons are those of sync scheduling, which stops it at once; no token past the
    grammar's end is output."""
    spec = lambda **kw: StructuredOutputsParams(**kw)
    constraints = [spec(regex=r"\d{3}-\d{4}"), spec(choice=["red", "green", "blue"])]
    requests = [(f"Q{i}:", SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=24,
                                          structured_outputs=c, output_kind=kind))
                for i, c in enumerate(constraints) for kind in (RequestOutputKind.CUMULATIVE,
                                                                  RequestOutputKind.DELTA)]
    requests.append(("Free:", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)))
    seen = {}
    for async_scheduling in (True, False):
        engine = make_engine(tiny_over_smollm2_vocab, async_scheduling=async_scheduling)
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(str(i), prompt, params)
        streamed, final = {}, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    tokens, text = streamed.get((out.request_id, c.index), ([], ""))
                    streamed[out.request_id, c.index] = tokens + c.token_ids, text + c.text
                if out.finished:
                    final[out.request_id] = [(c.token_ids, c.text, c.finish_reason,
                                              c.stop_reason) for c in out.outputs]
        for i in range(0, len(requests) - 1, 2):  # CUMULATIVE, then its DELTA twin
            for index, (tokens, text, reason, _) in enumerate(final[str(i)]):
                assert final[str(i + 1)][index][2] == reason
                assert streamed[str(i + 1), index] == (tokens, text)
        assert engine.structured.num_matchers == 0
        assert_engine_idle(engine)
        seen[async_scheduling] = final
    assert seen[True] == seen[False]
    stopped = [c for i in ("0", "2") for c in seen[True][i] if c[2] == "stop"]
    assert len(stopped) >= 3  # most samples end with their grammar, not at max_tokens
    eos = tiny_over_smollm2_vocab.config.eos_token_ids
    for tokens, text, _, _ in stopped:  # stopped by the grammar, before any EOS
        assert re.fullmatch(r"\d{3}-\d{4}|red|green|blue", text), text
        assert not set(tokens) & set(eos), tokens


def test_bad_constraints_are_refused_before_anything_is_queued(tiny_over_smollm2_vocab):
    engine = make_engine(tiny_over_smollm2_vocab)
    bad = [
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": 7}}}),
         "structured_outputs.json"),
        (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    ]
    for spec, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            engine.add_request("x", "hi", SamplingParams(structured_outputs=spec))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice=[])
    assert engine.get_num_unfinished_requests() == 0
    assert_engine_idle(engine)


def test_bitmask_bits_are_the_grammars_tokens(smollm2_header):
    """The host bitmask allows exactly the tokens the grammar accepts, and the sampler masks
    everything else (xgrammar's and llguidance's bit layout: bit j % 32 of word j // 32)."""
    config, tok = smollm2_header
    compiler = GrammarCompiler(tok, config.vocab_size, config.eos_token_ids)
    outputs = StructuredOutputs(compiler)
    spec = StructuredOutputsParams(choice=["yes", "no"])
    mask = outputs.fill(outputs.jobs([1], [7], lambda i: (spec, [])), num_rows=3)
    vocab = config.vocab_size
    allowed = np.asarray(unpack_bitmask(jnp.asarray(mask), vocab))
    assert allowed[0].all() and allowed[2].all()  # unconstrained rows
    ids = set(np.flatnonzero(allowed[1]).tolist())
    assert {tok.encode("yes")[0], tok.encode("no")[0]} <= ids and len(ids) < 50
    # The sampler never picks a masked token, even where the logits favour one.
    logits = np.zeros((3, vocab), np.float32)
    logits[:, 5] = 100.0  # id 5 is not a prefix of "yes" or "no"
    md = build_sampling_metadata([], 3, 0, 0, mask)
    out = sample(jnp.asarray(logits), md, all_greedy=True, use_top_k_top_p=False,
                 use_bitmask=True)
    picked = np.asarray(out.sampled).tolist()
    assert picked[0] == 5 and picked[2] == 5 and picked[1] in ids
    outputs.free(7)
    assert outputs.num_matchers == 0


def test_constrained_step_benchmark_smoke(smollm2_header):
    """benchmarks/constrained_step.py drives LLMEngine.step with stand-ins for the scheduler,
    runner and device; a few steps keep those in step with the engine's internals."""
    from types import SimpleNamespace

    from jaxllm.benchmarks.constrained_step import Work, measure

    config, tok = smollm2_header
    eos = tuple(config.eos_token_ids)
    args = SimpleNamespace(batch=8, steps=4, warmup=2, schedule_ms=0.0, prepare_ms=0.0,
                           launch_ms=0.0, forward_ms=0.1, sampler_ms=0.0, seed=0)
    compiler = GrammarCompiler(tok, config.vocab_size, eos)
    for rows in (0, 2):
        result = measure((StructuredOutputs(compiler), tok, eos, Work()), rows, args)
        assert result["rows"] == rows and result["tokens_per_s"] > 0
        assert (result["fill_ms_mean"] > 0) == (rows > 0)  # the grammar task ran, or not

