"""What schema fuzzing (benchmarks/fuzz_server.py) checks of each answer of a live ``jaxllm
serve``: :func:`check` (no 5xx and no timeout, every non-2xx body an OpenAI error body with the
status as its ``code``, a stream ending in ``data: [DONE]``, no 2xx for a body the schema
refuses, schemathesis' conformance checks), the requests' decode work bounded (:func:`cap`),
and the :class:`Tally` of outcomes and problems, each problem with its request to replay."""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from collections.abc import Callable

MAX_TOKENS = 2  # per generated request: fuzzing is about requests, not decode steps
MAX_N = 2
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
ERROR_KEYS = {"message", "type", "param", "code"}
# Seconds without an answer that count as a hang. Generous: on a loaded 2-core machine, the
# first request of a new step shape waits for its compile (2 minutes seen with 7 runnable
# processes).
REQUEST_TIMEOUT = 300.0
CONNECTION_FAILED = -1  # the status recorded when no connection could be made
PROBLEM_SAMPLES = 3  # replay lines kept per kind of problem


def cap(path: str, body: object) -> object:
    """``body`` with its decode work bounded (only where the fields are what the schema says:
    a wrongly typed value is left for the server to refuse)."""
    if path not in GENERATION_PATHS or not isinstance(body, dict):
        return body
    names = ("max_tokens",) if path == GENERATION_PATHS[0] else (
        "max_tokens", "max_completion_tokens")
    for name in names:
        value = body.get(name)
        if value is None or _is_int(value) and value > MAX_TOKENS:
            body[name] = MAX_TOKENS
    for name in ("n", "best_of"):
        if _is_int(body.get(name)) and body[name] > MAX_N:
            body[name] = MAX_N
    if _is_int(body.get("min_tokens")) and body["min_tokens"] > MAX_TOKENS:
        body["min_tokens"] = MAX_TOKENS
    return body

def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

def error_body_problem(status: int, content: bytes) -> str | None:
    """Why a non-2xx body is not the server's OpenAI error body, or None."""
    try:
        body = json.loads(content)
    except ValueError:
        return f"{status} with a body that is not JSON: {content[:120]!r}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(body) != {"error"} or set(error) != ERROR_KEYS:
        return f"{status} without the error envelope: {content[:200]!r}"
    if not (isinstance(error["message"], str) and isinstance(error["type"], str)
            and (error["param"] is None or isinstance(error["param"], str))):
        return f"{status} with mistyped error fields: {content[:200]!r}"
    if error["code"] != status:
        return f"{status} with code {error['code']!r}"
    return None

def stream_problem(content: bytes) -> str | None:
    """Why a 200 event stream is malformed (an event that is not JSON, an error event in the
    wrong shape, no final ``[DONE]``), or None."""
    events = content.decode("utf-8", "replace").split("\n\n")
    if events[-1] != "" or events[-2:-1] != ["data: [DONE]"]:
        return f"a stream that does not end with data: [DONE]: {content[-120:]!r}"
    for event in events[:-2]:
        if not event.startswith("data: "):
            return f"an event without data: {event[:120]!r}"
        try:
            payload = json.loads(event[6:])
        except ValueError:
            return f"an event that is not JSON: {event[:120]!r}"
        if isinstance(payload, dict) and "error" in payload:
            problem = error_body_problem(payload["error"].get("code", 0), event[6:].encode())
            if problem:
                return "in a stream: " + problem
    return None

def outcome(status: int | None) -> str:
    if status is None:
        return "timeout"
    if status == CONNECTION_FAILED:
        return "connection failed"
    return "2xx" if status < 300 else f"{status}" if status < 500 else f"5xx:{status}"

@dataclasses.dataclass
class Tally:
    """Requests sent per operation and mode, their outcome classes, and the problems seen."""

    counts: dict = dataclasses.field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    problems: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    problem_counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def record(self, label: str, mode: str, status: int | None, problems: list[str],
               replay: Callable[[], str]) -> None:
        with self.lock:
            self._record(label, mode, status, problems, replay)

    def _record(self, label: str, mode: str, status: int | None, problems: list[str],
                replay: Callable[[], str]) -> None:
        self.counts[f"{label} [{mode}]"][outcome(status)] += 1
        for problem in problems:
            first, _, detail = problem.partition("\n")
            kind = f"{label}: {first[:160]}"
            self.problem_counts[kind] += 1
            if len(self.problems[kind]) < PROBLEM_SAMPLES:
                self.problems[kind].append(replay() + (f" -> {detail}" if detail else ""))

    def as_json(self) -> dict:
        return {"requests": {k: dict(sorted(v.items())) for k, v in sorted(self.counts.items())},
                "total": sum(sum(v.values()) for v in self.counts.values()),
                "problems": {k: {"count": n, "replay": self.problems[k]}
                             for k, n in self.problem_counts.most_common()}}

def check(case, response, status: int | None) -> list[str]:
    """Every property a response breaks (empty when none): see the module docstring."""
    from schemathesis.core.failures import FailureGroup
    from schemathesis.specs.openapi import checks as openapi_checks

    if status is None:
        return [f"no answer within {REQUEST_TIMEOUT:g} s"]
    problems = []
    content = response.content
    if status >= 500:
        problems.append(f"a {status}: {content[:200]!r}")
    if status >= 400:
        problem = error_body_problem(status, content)
    elif response.headers.get("Content-Type", "").startswith("text/event-stream"):
        problem = stream_problem(content)
    else:
        problem = None
    if problem:
        problems.append(problem)
    if 200 <= status < 300 and case.body is not None:
        refusal = schema_refusal(case)  # schemathesis' AcceptedNegativeData, made readable
        if refusal:
            problems.append(f"accepted a body the schema refuses: {refusal}")
    try:
        case.validate_response(response, checks=[
            openapi_checks.status_code_conformance, openapi_checks.content_type_conformance,
            openapi_checks.response_headers_conformance,
            openapi_checks.response_schema_conformance])
    except FailureGroup as group:
        # the title names the kind of problem; the message (its detail) goes with the samples
        problems.extend(f"{type(e).__name__}: {e.title}\n{' '.join(e.message.split())[:300]}"
                        for e in group.exceptions)
    except AssertionError as e:
        problems.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return problems

def schema_refusal(case) -> str | None:
    """Why the operation's request schema refuses ``case.body`` (the deepest reason, with its
    path), or None when it accepts it."""
    import jsonschema

    document = case.operation.schema.raw_schema
    body = case.operation.definition.raw.get("requestBody")
    if body is None:
        return None
    schema = body["content"]["application/json"]["schema"]
    validator = jsonschema.Draft202012Validator(schema | {"components": document["components"]})
    error = jsonschema.exceptions.best_match(validator.iter_errors(case.body))
    if error is None:
        return None
    while error.context:  # anyOf / oneOf: the deepest of the alternatives' reasons
        error = jsonschema.exceptions.best_match(error.context)
    where = "/".join(str(p) for p in error.absolute_path)
    return f"at body/{where}: {error.message[:200]}"

def replay(case) -> str:
    """The request as sent, less the API key (schemathesis' curl line masks any field named
    like a token, e.g. add_special_tokens)."""
    sent = {"method": case.method, "path": case.formatted_path}
    for name in ("query", "headers", "body"):
        value = getattr(case, name, None)
        if value:
            sent[name] = dict(value) if name != "body" else value
    return json.dumps(sent, default=repr)[:2000]
