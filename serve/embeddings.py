"""POST /v1/embeddings: OpenAI's request and response, one engine request per input (they
batch with everything else in the engine), pooled as ``--pooler-config`` says.

The order of work is the completions endpoints': refuse while draining (503) -> parse and
validate (400/404) -> admit into the bounded queue (429) -> tokenize on the tokenizer thread
(400 for context overflow) -> embed. A client that goes away aborts every input's request.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import time

import numpy as np
from aiohttp import web
from jaxllm.serve.errors import APIError, bad_request
from jaxllm.serve.generation import STATE, check_model, read_json
from jaxllm.serve.prompts import check_context
from jaxllm.serve.protocol import MAX_PROMPTS, Fields, check_token_ids
from jaxllm.serve.state import ServerState, Ticket

from jaxllm.engine.engine_client import EngineDeadError
from jaxllm.engine.outputs import EmbeddingRequestOutput
from jaxllm.pooling_params import PoolingParams

ENCODING_FORMATS = ("float", "base64")
INT32 = 2**31 - 1


@dataclasses.dataclass
class EmbeddingRequest:
    model: str | None
    inputs: list[str | list[int]]
    encoding_format: str
    params: PoolingParams
    priority: int = 0
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None


def parse_embedding(body: object, *, vocab_size: int, pooler: PoolingParams) -> EmbeddingRequest:
    f = Fields(body)
    if f.present("dimensions"):
        raise bad_request("dimensions is not supported: this model's embeddings have one "
                          "size (its hidden size)", "dimensions")
    if f.present("messages"):
        raise bad_request("messages is not supported: send the text to embed as input",
                          "messages")
    inputs = f.raw("input")
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs
                                   and all(isinstance(t, int) for t in inputs)):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs:
        raise bad_request("input must be a non-empty string, a list of strings, a list of "
                          "token ids, or a list of lists of token ids", "input")
    if len(inputs) > MAX_PROMPTS:
        raise bad_request(f"input takes at most {MAX_PROMPTS} items, got {len(inputs)}",
                          "input")
    for item in inputs:
        if isinstance(item, str):
            if not item:
                raise bad_request("input must not contain empty strings", "input")
        elif isinstance(item, list) and item:
            check_token_ids(item, vocab_size, "input")
        else:
            raise bad_request("each input must be a non-empty string or a non-empty list of "
                              "token ids", "input")
    encoding = f.str("encoding_format", "float")
    if encoding not in ENCODING_FORMATS:
        raise bad_request(f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, "
                          f"got {encoding!r}", "encoding_format")
    f.str("user")  # accepted and unused, as OpenAI's
    params = dataclasses.replace(pooler, normalize=f.bool("normalize", pooler.normalize))
    return EmbeddingRequest(
        f.str("model"), inputs, encoding, params, priority=f.int("priority", 0, -INT32, INT32),
        add_special_tokens=f.bool("add_special_tokens", True),
        truncate_prompt_tokens=f.int("truncate_prompt_tokens", None, 1))



def tokenize_inputs(tokenizer, req: EmbeddingRequest, max_model_len: int) -> list[list[int]]:
    """Runs on the tokenizer thread: token ids per input, checked against the context."""
    prompts = []
    for item in req.inputs:
        if isinstance(item, list):
            ids = list(item)
        elif tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids as input", "input")
        else:
            ids = list(tokenizer(item, add_special_tokens=req.add_special_tokens)["input_ids"])
            if not ids:
                raise bad_request("an input tokenizes to no tokens", "input")
        if req.truncate_prompt_tokens is not None:
            ids = ids[-req.truncate_prompt_tokens:]
        check_context(len(ids), None, max_model_len)
        prompts.append(ids)
    return prompts


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.check_accepting()
    state.begin()
    try:
        req = parse_embedding(await read_json(request), vocab_size=state.vocab_size,
                              pooler=state.config.pooler_config)
        check_model(state, req.model)
        ticket = state.admission.admit(len(req.inputs))
        try:
            prompts = await state.in_tokenizer_thread(tokenize_inputs, state.tokenizer, req,
                                                      state.max_model_len)
            request_id = state.new_request_id("embd")
            outs = await _embed_all(state, request_id, prompts, req, ticket)
        finally:
            ticket.close()
    finally:
        state.end()
    return web.json_response(response_body(request_id, state.model_name, req, prompts, outs))


async def _embed_all(state: ServerState, request_id: str, prompts: list[list[int]],
                     req: EmbeddingRequest, ticket: Ticket) -> list[EmbeddingRequestOutput]:
    tasks = [asyncio.ensure_future(_embed_one(state, f"{request_id}-{i}", ids, req, ticket, i))
             for i, ids in enumerate(prompts)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:  # one input failed or the client left: the others are cancelled (and aborted)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _embed_one(state: ServerState, engine_id: str, ids: list[int], req: EmbeddingRequest,
                     ticket: Ticket, index: int) -> EmbeddingRequestOutput:
    if state.aborting:
        raise APIError("The server is shutting down.", 503, headers={"Connection": "close"})
    state.active.add(engine_id)
    try:
        stream = state.engine.generate(engine_id, None, req.params, prompt_token_ids=ids,
                                       priority=req.priority)
        async with contextlib.aclosing(stream):
            async for out in stream:
                ticket.release(index)
                if out.finished:
                    if out.outputs is None:
                        raise APIError("The request was aborted before its embedding was "
                                       "computed.", 503)
                    return out
        raise APIError("The engine ended the request without an embedding.", 500)
    except ValueError as e:  # refused by the engine before it queued anything
        raise bad_request(str(e), "input") from None
    except EngineDeadError as e:
        raise APIError(f"The engine failed while running this request: {e}", 500) from None
    finally:
        state.active.discard(engine_id)


def response_body(request_id: str, model: str, req: EmbeddingRequest, prompts: list[list[int]],
              outs: list[EmbeddingRequestOutput]) -> dict:
    data = []
    for i, out in enumerate(outs):
        vector = out.outputs.embedding
        if req.encoding_format == "base64":  # OpenAI's: little-endian float32 bytes
            vector = base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": vector})
    tokens = sum(len(p) for p in prompts)
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
