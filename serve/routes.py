"""The small endpoints: health, liveness, version, models, tokenize, detokenize, metrics,
openapi.json."""

from __future__ import annotations

from aiohttp import web
from jaxllm.serve.errors import APIError, bad_request
from jaxllm.serve.generation import STATE, check_model, read_json
from jaxllm.serve.openapi import Limits, openapi_document
from jaxllm.serve.prompts import render_chat
from jaxllm.serve.protocol import Fields, GenerationRequest, check_token_ids, parse_messages
from prometheus_client import CONTENT_TYPE_LATEST

import jaxllm
from jaxllm.sampling_params import SamplingParams


async def health(request: web.Request) -> web.Response:
    """Ready: 200 with an empty body; 503 while draining or after the engine died."""
    state = request.app[STATE]
    if state.draining:
        raise APIError("The server is shutting down.", 503)
    if not state.engine_alive:
        raise APIError("The engine has stopped after an internal error.", 503)
    return web.Response(status=200)


async def live(request: web.Request) -> web.Response:
    """Alive: 200 while the process can serve (draining included); 503 once the engine died."""
    if not request.app[STATE].engine_alive:
        raise APIError("The engine has stopped after an internal error.", 503)
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": jaxllm.__version__})


def _model_card(state, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "jaxllm",
            "root": state.model_names[0], "parent": None, "max_model_len": state.max_model_len,
            "permission": []}


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list",
                              "data": [_model_card(state, n) for n in state.model_names]})


async def model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    check_model(state, name)
    return web.json_response(_model_card(state, name))


async def tokenize(request: web.Request) -> web.Response:
    """``{prompt}`` or ``{messages}`` -> ``{count, max_model_len, tokens}``."""
    state = request.app[STATE]
    f = Fields(await read_json(request))
    check_model(state, f.str("model"))
    if f.present("messages"):
        req = GenerationRequest(chat=True, model=None, params=SamplingParams(),
                                messages=parse_messages(f.raw("messages")),
                                add_special_tokens=f.bool("add_special_tokens", False),
                                add_generation_prompt=f.bool("add_generation_prompt", True))
        ids = (await state.in_tokenizer_thread(render_chat, state.tokenizer, req)).token_ids
    else:
        prompt = f.str("prompt")
        if not prompt:
            raise bad_request("prompt (a non-empty string) or messages is required", "prompt")
        if state.tokenizer is None:
            raise bad_request("this model has no tokenizer", "prompt")
        add_special = f.bool("add_special_tokens", True)
        ids = (await state.in_tokenizer_thread(
            lambda: state.tokenizer(prompt, add_special_tokens=add_special)))["input_ids"]
    return web.json_response({"count": len(ids), "max_model_len": state.max_model_len,
                              "tokens": list(ids)})


async def detokenize(request: web.Request) -> web.Response:
    """``{tokens}`` -> ``{prompt}``."""
    state = request.app[STATE]
    f = Fields(await read_json(request))
    check_model(state, f.str("model"))
    if not f.present("tokens"):
        raise bad_request("tokens (a list of token ids) is required", "tokens")
    ids = check_token_ids(f.raw("tokens"), state.vocab_size, "tokens")
    if state.tokenizer is None:
        raise bad_request("this model has no tokenizer", "tokens")
    text = await state.in_tokenizer_thread(state.tokenizer.decode, ids)
    return web.json_response({"prompt": text})


async def openapi_json(request: web.Request) -> web.Response:
    state = request.app[STATE]
    limits = Limits(state.max_model_len, state.max_num_seqs, state.vocab_size)
    return web.json_response(openapi_document(state.model_names, jaxllm.__version__,
                                              auth=state.config.api_key is not None,
                                              limits=limits))


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    await state.snapshots.refresh()
    return web.Response(body=state.metrics.render(),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})
