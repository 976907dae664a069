"""Per-request sampling parameters, with vLLM's names, defaults and validation ranges."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from typing import Any

GREEDY_TEMPERATURE = 1e-5  # below this, temperature means greedy (as in vLLM)
MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """What each of a request's outputs holds (vLLM's names): the whole output so far, only
    what is new since the previous output, or one output when the request finishes."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on the output, as vLLM's ``structured_outputs`` names them: exactly one
    of ``json`` (a JSON schema, as a dict or its JSON text), ``regex``, ``choice`` (the output
    is one of these strings), ``grammar`` (Lark or GBNF/EBNF) or ``json_object`` (any JSON
    object). The grammar engine compiles it when the request is added (jaxllm.structured)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False  # JSON: no whitespace beyond a separator's own

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):  # canonical text: hashable, and one cache key
            object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        for flag in ("json_object", "disable_any_whitespace"):  # also: the cache key hashes them
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"structured_outputs.{flag} must be a boolean")
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                          else [])
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, "
                             f"grammar or json_object, got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, str):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured_outputs.grammar must be a string")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                             "strings")

    @property
    def kind(self) -> str:
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, name) not in (None, False))

    @classmethod
    def from_dict(cls, value: Any) -> StructuredOutputsParams:
        """From a request's ``structured_outputs`` object (unknown keys are refused)."""
        if not isinstance(value, dict):
            raise ValueError("structured_outputs must be an object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {unknown}; expected "
                             f"{sorted(names)}")
        return cls(**{k: v for k, v in value.items() if v is not None})


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. ``temperature=0`` is greedy; ``top_k`` 0 or -1 is off."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # prompt + output tokens; >1 discourages repeats
    presence_penalty: float = 0.0  # output tokens only
    frequency_penalty: float = 0.0  # output tokens only
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per output token, plus the chosen one
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # Accept a single string / lists from callers, store tuples (hashable, frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        def number(name: str) -> float:
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and not isinstance(value, bool)
                 and math.isfinite(value), f"{name} must be a finite number, got {value!r}")
            return value

        need(isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}")
        need(number("temperature") >= 0, f"temperature must be non-negative, got "
                                          f"{self.temperature}")
        need(0 < number("top_p") <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(isinstance(self.top_k, int) and self.top_k >= 0,
             f"top_k must be -1 (disable), or at least 1, got {self.top_k}")
        need(0 <= number("min_p") <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        need(0 < number("repetition_penalty") <= 2,
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        need(-2 <= number("presence_penalty") <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(-2 <= number("frequency_penalty") <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(self.max_tokens is None or (isinstance(self.max_tokens, int)
                                         and self.max_tokens >= 1),
             f"max_tokens must be at least 1, got {self.max_tokens}")
        need(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
             f"min_tokens must be greater than or equal to 0, got {self.min_tokens}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
             f"got {self.min_tokens}")
        need(self.logprobs is None or (isinstance(self.logprobs, int)
                                       and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        need(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got "
                                                              f"{self.seed!r}")
        need(all(isinstance(s, str) and s for s in self.stop),
             "stop must be a string or a list of non-empty strings")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers")
        need(self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs must be a StructuredOutputsParams")
        need(isinstance(self.output_kind, RequestOutputKind),
             f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        need(not (self.is_greedy and self.n > 1),
             f"n must be 1 when using greedy sampling, got {self.n}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)
