"""A request's output constraint: OpenAI's ``response_format``, vLLM's ``structured_outputs``
and its older ``guided_*`` fields, read into one :class:`StructuredOutputsParams` (at most one
of them per request; 400 naming the field otherwise)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from jaxllm.serve.errors import bad_request

from jaxllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from jaxllm.serve.protocol import Fields

# vLLM's older top-level structured-output fields (removed from vLLM in 0.12; still honoured
# here, so old clients get what they asked for instead of unconstrained text).
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")
# A constraint's text (schema JSON, regex, grammar, choices): each one is compiled when its
# request arrives, so an unbounded one is unbounded work on the tokenizer threads.
MAX_CONSTRAINT_CHARS = 64 * 1024


def structured_outputs(f: Fields) -> tuple[str, StructuredOutputsParams] | None:
    """(the field it came from, the request's output constraint): OpenAI's
    ``response_format``, vLLM's ``structured_outputs``, or one of the older ``guided_*``
    fields; at most one of them."""
    found: list[tuple[str, dict]] = []
    response_format = f.object("response_format")
    kind = response_format.get("type", "text")
    if kind == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object with a 'schema'",
                              "response_format")
        for key, kind in (("name", str), ("description", str), ("strict", bool)):
            if spec.get(key) is not None and not isinstance(spec[key], kind):
                raise bad_request(f"response_format.json_schema.{key} must be a "
                                  f"{'string' if kind is str else 'boolean'}", "response_format")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            found.append(("response_format", {"json_object": True}))
        elif not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema "
                              "object", "response_format")
        else:
            found.append(("response_format", {"json": schema}))
    elif kind != "text":
        raise bad_request(f"response_format.type must be 'text', 'json_object' or "
                          f"'json_schema', got {kind!r}"[:200], "response_format")
    if f.present("structured_outputs"):
        found.append(("structured_outputs", f.object("structured_outputs")))
    for name, key in GUIDED_FIELDS.items():
        if f.present(name):
            found.append((name, {key: f.raw(name)}))
    backend = f.raw("guided_decoding_backend", "auto")
    if backend not in GRAMMAR_BACKENDS:
        raise bad_request(f"guided_decoding_backend must be one of {list(GRAMMAR_BACKENDS)} "
                          f"(this server's grammar engine is llguidance), got {backend!r}"[:200],
                          "guided_decoding_backend")
    if not found:
        return None
    if len(found) > 1:
        raise bad_request("only one output constraint may be given, got "
                          f"{', '.join(name for name, _ in found)}", found[1][0])
    name, value = found[0]
    if value.get("choice") is not None and not isinstance(value["choice"], list):
        # a string would pass as the list of its characters
        raise bad_request(f"{name}: choice must be a non-empty list of non-empty strings", name)
    if name in GUIDED_FIELDS and name != "guided_choice" and name != "guided_json" \
            and not isinstance(value[GUIDED_FIELDS[name]], str):
        raise bad_request(f"{name} must be a string", name)
    if name == "guided_json" and isinstance(value["json"], str):
        try:
            value = {"json": json.loads(value["json"])}
        except ValueError:
            raise bad_request("guided_json must be a JSON schema (an object or its JSON "
                              "text)", name) from None
    try:
        params = StructuredOutputsParams.from_dict(value)
    except (ValueError, TypeError) as e:
        raise bad_request(f"{name}: {e}" if not str(e).startswith("structured_outputs")
                          else str(e), name) from None
    size = len(params.json or params.regex or params.grammar or "") + sum(
        len(c) for c in params.choice or ())
    if size > MAX_CONSTRAINT_CHARS:
        raise bad_request(f"{name}: the constraint is {size} characters, more than this "
                          f"server's limit of {MAX_CONSTRAINT_CHARS}", name)
    return name, params
