"""A request's constraint as an llguidance grammar, compiled once per distinct constraint.

llguidance rather than xgrammar (benchmarks/grammar_engines.py; figures and reasons in
benchmarks/RESULTS.md, issue 19): xgrammar fills masks faster, but its wheel requires torch,
triton and transformers, and the fill runs off the engine's critical path (its own thread);
llguidance needs nothing else and compiles a new schema faster.

Host side only (no jax). ``GrammarCompiler.compile`` runs where a request is admitted (the
server's tokenizer thread, or ``LLMEngine.add_request``), never inside a step.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from typing import Any

from jaxllm.sampling_params import StructuredOutputsParams

# What JSON output may hold between tokens when ``disable_any_whitespace`` is set: one space
# after ',' and ':', nothing else (the compact style models write anyway).
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Otherwise a bounded run of whitespace: free whitespace lets a sampled model pad forever.
_FLEXIBLE_JSON = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,8}"}
ANY_JSON_OBJECT = {"type": "object"}


def _json_grammar(schema_text: str, compact: bool) -> str:
    import llguidance

    try:
        schema = json.loads(schema_text)
    except ValueError as e:
        raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("structured_outputs.json must be a JSON schema (an object)")
    options = _COMPACT_JSON if compact else _FLEXIBLE_JSON
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except (ValueError, RuntimeError, TypeError) as e:
        raise ValueError(f"structured_outputs.json: invalid JSON schema: {e}") from None


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for one constraint (ValueError naming the field when bad)."""
    import llguidance

    kind = spec.kind
    try:
        if kind == "json":
            return _json_grammar(spec.json, spec.disable_any_whitespace)
        if kind == "json_object":
            return _json_grammar(json.dumps(ANY_JSON_OBJECT), spec.disable_any_whitespace)
        if kind == "regex":
            re.compile(spec.regex)  # a clearer message than the engine's for Python's syntax
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", list(spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)
    except re.error as e:
        raise ValueError(f"structured_outputs.regex is not a valid regular expression: "
                         f"{e}") from None
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"structured_outputs.{kind}: {e}") from None
    except ValueError as e:
        if str(e).startswith("structured_outputs"):
            raise
        raise ValueError(f"structured_outputs.{kind}: {e}") from None


class GrammarCompiler:
    """Compiles and validates constraints against one tokenizer; thread-safe, cached."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = 1024):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logit rows (may exceed the tokenizer's)
        self.eos_token_ids = tuple(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self.compile = functools.lru_cache(maxsize=cache_size)(self._compile)

    @property
    def ll_tokenizer(self):
        """llguidance's index of the vocabulary (~1 s to build: once, on first use)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                # The model's EOS ids that the tokenizer knows (a model may pair with another
                # tokenizer, as the benchmarks' dummy presets do); else the tokenizer's own.
                known = [t for t in self.eos_token_ids if t < len(self._hf_tokenizer)]
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=known or None)
            return self._ll_tokenizer

    def _compile(self, spec: StructuredOutputsParams) -> str:
        """The grammar text, checked against the vocabulary (ValueError when it cannot be
        compiled). Matchers built from it never fail on the grammar itself."""
        import llguidance

        grammar = grammar_text(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise ValueError(f"structured_outputs.{spec.kind}: the grammar cannot be compiled: "
                             f"{error[:500]}")
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar)  # builds the lexer now
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{spec.kind}: the grammar cannot be compiled: "
                             f"{matcher.get_error()[:500]}")
        return grammar
