"""Prompts to token ids: chat templates (rendered in transformers' sandboxed Jinja
environment), tokenization, and vLLM's context-length checks. Runs on the tokenizer thread."""

from __future__ import annotations

import dataclasses
from typing import Any

import jinja2
from jaxllm.serve.errors import APIError, bad_request
from jaxllm.serve.protocol import GenerationRequest
from jaxllm.serve.tools import template_messages


@dataclasses.dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # the prompt as text (None for token-id prompts until decoded)


def encode(tokenizer: Any, req: GenerationRequest, max_model_len: int,
           chat_template: str | None = None) -> list[Prompt]:
    """Renders / tokenizes every prompt of ``req`` and checks it against the context.
    ``chat_template``: the server's --chat-template, replacing the tokenizer's."""
    if req.chat:
        prompts = [render_chat(tokenizer, req, chat_template)]
    else:
        prompts = [Prompt(list(p), None) if isinstance(p, list)
                   else Prompt(_tokenize(tokenizer, p, req.add_special_tokens), p)
                   for p in req.prompts]
    for prompt in prompts:
        if req.truncate_prompt_tokens is not None:
            if len(prompt.token_ids) > req.truncate_prompt_tokens:
                prompt.token_ids = prompt.token_ids[-req.truncate_prompt_tokens:]
                prompt.text = None
        check_context(len(prompt.token_ids), req.params.max_tokens, max_model_len)
        if req.echo and prompt.text is None and tokenizer is not None:
            prompt.text = tokenizer.decode(prompt.token_ids)
    return prompts


def render_chat(tokenizer: Any, req: GenerationRequest,
                chat_template: str | None = None) -> Prompt:
    if tokenizer is None or (chat_template is None
                             and getattr(tokenizer, "chat_template", None) is None):
        raise bad_request("this model has no chat template: use /v1/completions "
                          "(or serve with --chat-template)", "messages")
    tools = [dict(t) for t in req.tools.tools] if req.tools is not None else None
    try:
        text = tokenizer.apply_chat_template(
            template_messages(req.messages), tools=tools, chat_template=chat_template,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, tokenize=False,
            **req.chat_template_kwargs)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        raise bad_request(f"the chat template cannot render these messages: {e}",
                          "messages") from None
    return Prompt(_tokenize(tokenizer, text, req.add_special_tokens), text)


def _tokenize(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    if tokenizer is None:
        raise bad_request("this model has no tokenizer: send token ids as the prompt", "prompt")
    ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    if not ids:
        raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.",
                          "prompt")
    return list(ids)


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """vLLM's checks and messages: the prompt must leave room for one token, and an explicit
    max_tokens must fit in what is left (it is rejected, never clamped)."""
    if num_prompt_tokens >= max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt_tokens} input tokens. Please reduce the length of the "
            "input messages.", 400, param="input_tokens")
    if max_tokens is not None and max_tokens > max_model_len - num_prompt_tokens:
        raise APIError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
            f"maximum context length is {max_model_len} tokens and your request has "
            f"{num_prompt_tokens} input tokens ({max_tokens} > {max_model_len} - "
            f"{num_prompt_tokens}).", 400, param="max_tokens")
