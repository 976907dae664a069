"""POST /v1/completions and /v1/chat/completions.

The order of work is the contract: refuse while draining (503) -> read and parse the body
(413/400) -> validate fields (400/404) -> admit into the bounded queue (429, nothing tokenized
yet) -> render/tokenize on the tokenizer thread (400 for context overflow) -> generate. A
stream's 200 is sent with its first output, so errors before that get their real status;
later errors go in-band as an SSE error event before ``[DONE]``. Closing the output iterator,
which happens when the client goes away (handler cancelled or write failed), aborts the
requests in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator

from aiohttp import web
from jaxllm.serve.errors import APIError, bad_request, error_body
from jaxllm.serve.prompts import Prompt, encode
from jaxllm.serve.protocol import GenerationRequest, parse_chat, parse_completion
from jaxllm.serve.responses import DONE, ResponseBuilder, sse
from jaxllm.serve.state import ServerState, Ticket

from jaxllm.engine.engine_client import EngineDeadError
from jaxllm.engine.outputs import RequestOutput

logger = logging.getLogger("serve")
STATE = web.AppKey("state", ServerState)
CLIENT_GONE = 499  # the status the HTTP metrics record when the client disconnected
# The status a handler records for the HTTP metrics when it differs from the response's.
STATUS = web.RequestKey("status", int)


async def read_json(request: web.Request) -> object:
    timeout = request.app[STATE].config.request_body_timeout
    try:  # 413 past client_max_size (--max-request-body-bytes)
        body = await asyncio.wait_for(request.read(), timeout)
    except TimeoutError:
        raise APIError(f"the request body did not arrive within {timeout:g} s "
                       "(--request-body-timeout)", 408, headers={"Connection": "close"}) from None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("the request body is not valid UTF-8") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {str(e)[:200]}") from None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_names:
        raise APIError(f"The model `{model}` does not exist.", 404, param="model")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    state.check_accepting()
    state.begin()
    try:
        return await _admit_and_run(request, state, chat, arrival)
    finally:
        state.end()


async def _admit_and_run(request: web.Request, state: ServerState, chat: bool,
                         arrival: float) -> web.StreamResponse:
    body = await read_json(request)
    if chat:
        req = parse_chat(body, vocab_size=state.vocab_size, max_n=state.max_num_seqs,
                         auto_tools=state.config.enable_auto_tool_choice)
    else:
        req = parse_completion(body, vocab_size=state.vocab_size, max_n=state.max_num_seqs)
    check_model(state, req.model)
    ticket = state.admission.admit(1 if chat else len(req.prompts))
    try:
        prompts: list[Prompt] = await state.in_tokenizer_thread(
            encode, state.tokenizer, req, state.max_model_len, state.config.chat_template)
        if req.params.structured_outputs is not None:  # compiled here, not in the step loop
            await state.in_tokenizer_thread(state.compile_grammar, req)
        request_id = state.new_request_id("chatcmpl" if chat else "cmpl")
        builder = ResponseBuilder(req, request_id, state.model_name,
                                  [len(p.token_ids) for p in prompts],
                                  [p.text or "" for p in prompts], state.token_text,
                                  state.config.tool_call_parser)
        outputs = _outputs(state, request_id, prompts, req, ticket, arrival)
        async with contextlib.aclosing(outputs):
            if req.stream:
                return await _stream(request, builder, outputs)
            try:
                async for index, out in outputs:
                    builder.add(index, out)
            except EngineDeadError as e:
                raise _engine_failed(e) from None
            return web.json_response(builder.full())
    finally:
        ticket.close()


async def _stream(request: web.Request, builder: ResponseBuilder,
                  outputs: AsyncIterator[tuple[int, RequestOutput]]) -> web.StreamResponse:
    try:
        first = await anext(outputs, None)
    except EngineDeadError as e:
        raise _engine_failed(e) from None
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    stall = request.app[STATE].config.stream_stall_timeout
    try:
        await response.prepare(request)
        await _send(response, stall, builder.first_chunks())
        if first is not None:
            await _send(response, stall, builder.deltas(*first))
            try:
                async for index, out in outputs:
                    await _send(response, stall, builder.deltas(index, out))
            except EngineDeadError as e:
                error = _engine_failed(e)
                await _send(response, stall, [error_body(error.message, error.status), DONE])
                return response
        usage = [builder.usage_chunk()] if builder.req.include_usage else []
        await _send(response, stall, [*usage, DONE])
        await response.write_eof()
    except ConnectionError:  # the client went away mid-stream; closing `outputs` aborts
        request[STATUS] = CLIENT_GONE
    return response


async def _send(response: web.StreamResponse, stall: float, events: list) -> None:
    """One write for a step's events (chunk dicts, or ready bytes). A client that has taken
    nothing for ``stall`` seconds (it stopped reading: its socket and our buffer are full)
    counts as gone, so its request is aborted and its blocks freed."""
    if not events:
        return
    data = b"".join(e if isinstance(e, bytes) else sse(e) for e in events)
    try:
        await asyncio.wait_for(response.write(data), stall)
    except TimeoutError:
        raise ConnectionResetError(f"the client read nothing of its stream for {stall:g} s") \
            from None


async def _outputs(state: ServerState, request_id: str, prompts: list[Prompt],
                   req: GenerationRequest, ticket: Ticket,
                   arrival: float) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, delta output) of every prompt's engine request, interleaved."""
    streams = [_one(state, f"{request_id}-{i}", p, req, ticket, i, arrival)
               for i, p in enumerate(prompts)]
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:
            async for out in stream:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    queue.put_nowait((index, out))
            queue.put_nowait((index, end))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _one(state: ServerState, engine_id: str, prompt: Prompt, req: GenerationRequest,
               ticket: Ticket, index: int, arrival: float) -> AsyncIterator[RequestOutput]:
    if state.aborting:  # tokenized after the drain deadline: it never reaches the engine
        raise APIError("The server is shutting down.", 503, headers={"Connection": "close"})
    tracker = state.metrics.tracker(arrival, req.params.n)
    if state.config.enable_log_requests:  # request content is logged only when asked for
        limit = state.config.max_log_len
        logger.info("received request %s: prompt: %r, prompt_token_ids: %s, params: %s",
                    engine_id, (prompt.text or "")[:limit], list(prompt.token_ids)[:limit],
                    req.params)
    state.active.add(engine_id)
    try:
        stream = state.engine.generate(engine_id, prompt.text, req.params,
                                       prompt_token_ids=prompt.token_ids,
                                       priority=req.priority)
        async with contextlib.aclosing(stream):
            async for out in stream:
                ticket.release(index)
                tracker.update(out)
                yield out
    except ValueError as e:  # refused by the engine before it queued anything
        tracker.discard()
        raise bad_request(str(e), "prompt") from None
    finally:
        ticket.release(index)
        tracker.finish()
        state.active.discard(engine_id)


def _engine_failed(error: EngineDeadError) -> APIError:
    logger.error("request failed: %s", error)
    return APIError(f"The engine failed while running this request: {error}", 500)
