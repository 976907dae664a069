"""xgrammar vs llguidance on the host work structured outputs add to serving, measured on the
SmolLM2 tokenizer (49,152 ids):

- index: building the engine's tokenizer index (once per model);
- first mask: a new request's grammar compiled and its first bitmask filled (once per request;
  xgrammar caches a compiled schema, so a repeated schema is timed too);
- step: one decode step's bitmasks for R constrained rows (each row walking the tokens of a
  valid document of its schema), filled by the engine's batch call, then one token accepted
  per row. This is the per-step host cost the engine overlaps with the running step.

Every sampled token must be allowed by its row's mask (checked). xgrammar needs torch and
transformers, so this runs in the reference venv (``make fixtures``) with both engines
installed there::

    .venv-ref/bin/pip install --no-deps xgrammar apache-tvm-ffi llguidance
    .venv/bin/python -m jaxllm.benchmarks.export_tokenizer /tmp/smollm2_tokenizer.json
    .venv-ref/bin/python benchmarks/grammar_engines.py --tokenizer /tmp/smollm2_tokenizer.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

# (schema, a valid instance): nested objects, arrays, enums, bounded numbers, required fields.
CASES = [
    ({"type": "object", "properties": {"name": {"type": "string"},
                                       "age": {"type": "integer", "minimum": 0, "maximum": 150}},
      "required": ["name", "age"]},
     {"name": "Ada Lovelace", "age": 36}),
    ({"type": "object", "properties": {
        "city": {"type": "string"},
        "forecast": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
            "type": "object", "properties": {
                "day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                "celsius": {"type": "number", "minimum": -60, "maximum": 60}},
            "required": ["day", "celsius"]}}},
      "required": ["city", "forecast"]},
     {"city": "Paris", "forecast": [{"day": "mon", "celsius": 12.5},
                                    {"day": "tue", "celsius": -3}]}),
    ({"type": "object", "properties": {
        "order": {"type": "object", "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "items": {"type": "array", "items": {"type": "string"}},
            "express": {"type": "boolean"}},
            "required": ["id", "items", "express"]}},
      "required": ["order"]},
     {"order": {"id": "ABC-1234", "items": ["tea", "milk"], "express": True}}),
]


def load_tokenizer(path: str):
    """SmolLM2's tokenizer from the tokenizer.json that benchmarks/export_tokenizer.py
    writes (its EOS is <|im_end|>, id 2)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<|im_end|>")


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=os.cpu_count() or 1)
        self.batch = xgr.BatchGrammarMatcher()

    def new_matcher(self, schema):
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema)))

    def fill(self, matchers, rows, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    @staticmethod
    def accept(matcher, token):
        return matcher.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.ll = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor()
        self._fill_par = llguidance.numpy.fill_next_token_bitmask_par

    def new_matcher(self, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.ll.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matchers, rows, bitmask):
        self._fill_par(self.executor, list(zip(matchers, rows, strict=True)), bitmask)

    @staticmethod
    def accept(matcher, token):
        return matcher.consume_token(token)


def allowed(bitmask: np.ndarray, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def measure(engine_cls, tokenizer, vocab_size, rows: int) -> dict:
    engine, index_s = timed(lambda: engine_cls(tokenizer, vocab_size))
    first_mask = {}
    words = -(-vocab_size // 32)
    one = np.full((1, words), -1, np.int32)
    for case, (schema, _) in enumerate(CASES):
        for attempt in ("new", "repeat"):
            def first(schema=schema):
                engine.fill([engine.new_matcher(schema)], [0], one)
            first_mask[f"schema{case}_{attempt}_ms"] = timed(first)[1] * 1e3
    # R rows, each walking a valid document of one of the schemas (rows spread over them).
    docs = [tokenizer.encode(json.dumps(inst), add_special_tokens=False) for _, inst in CASES]
    eos = tokenizer.eos_token_id
    walks = [docs[r % len(docs)] + [eos] for r in range(rows)]
    matchers = [engine.new_matcher(CASES[r % len(CASES)][0]) for r in range(rows)]
    bitmask = np.full((rows, words), -1, np.int32)
    fill_s, accept_s = [], []
    for step in range(max(map(len, walks))):
        live = [r for r in range(rows) if step < len(walks[r])]  # finished rows get no mask
        live_matchers = [matchers[r] for r in live]
        start = time.perf_counter()
        engine.fill(live_matchers, live, bitmask)
        fill_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        for r in live:
            token = walks[r][step]
            if not allowed(bitmask, r, token):
                raise AssertionError(f"{engine.name}: row {r} step {step}: token {token} "
                                     "of a valid document is masked")
            engine.accept(matchers[r], token)
        accept_s.append(time.perf_counter() - start)
    return {"index_s": index_s, **first_mask, "rows": rows, "steps": len(fill_s),
            "fill_ms_median": statistics.median(fill_s) * 1e3,
            "fill_ms_p90": float(np.percentile(fill_s, 90)) * 1e3,
            "accept_ms_median": statistics.median(accept_s) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json (SmolLM2's)")
    parser.add_argument("--rows", type=int, default=256, help="constrained rows per step")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    vocab_size = len(tokenizer)
    results = {"cpu_count": os.cpu_count(), "vocab_size": vocab_size, "engines": {}}
    for cls in (XGrammar, LLGuidance):
        version = importlib.metadata.version(cls.name)
        results["engines"][f"{cls.name} {version}"] = measure(cls, tokenizer, vocab_size,
                                                              args.rows)
    keys = list(next(iter(results["engines"].values())))
    print(f"{'':28}" + "".join(f"{name:>22}" for name in results["engines"]))
    for key in keys:
        print(f"{key:28}" + "".join(f"{r[key]:>22.3f}" if isinstance(r[key], float)
                                    else f"{r[key]:>22}" for r in results["engines"].values()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
