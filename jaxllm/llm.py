"""Offline API: ``LLM(model).generate(prompts, SamplingParams(...))`` and ``.chat(messages)``."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from typing import Any

from jaxllm.engine import gc_watch
from jaxllm.engine.engine_config import EngineConfig
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.engine.outputs import EmbeddingRequestOutput, RequestOutput
from jaxllm.loading import LoadedModel
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

Prompt = str | Sequence[int] | dict


def configure_default_logging() -> bool:
    """Shows jaxllm's INFO lines (the resolved limits, "engine ready in ...: weights, KV cache,
    warm-up") on stderr when nothing else would: no handler on the root or the ``jaxllm``
    logger, and ``JAXLLM_CONFIGURE_LOGGING`` not "0" (vLLM's ``VLLM_CONFIGURE_LOGGING``). Its
    own handler, not propagated, so that a root handler added later does not print twice.
    Returns whether it configured the logger."""
    package = logging.getLogger("jaxllm")
    if (os.environ.get("JAXLLM_CONFIGURE_LOGGING", "1") == "0" or package.handlers
            or logging.getLogger().handlers):
        return False
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    package.propagate = False
    return True


class LLM:
    """An engine for batch generation in-process.

    >>> llm = LLM(max_num_seqs=8, max_model_len=512)      # the embedded default model
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0,
    ...                    max_tokens=3), use_tqdm=False)
    >>> out[0].outputs[0].text
    ' Paris.'
    """

    def __init__(self, model: str | LoadedModel | None = None, **engine_args: Any):
        """``model``: a HF directory, .gguf file, an already loaded model, or None for the
        embedded default; ``engine_args``: any :class:`EngineConfig` field."""
        progress = engine_args.pop("progress", True)
        configure_default_logging()
        if isinstance(model, LoadedModel):
            config = EngineConfig(**engine_args)
        else:
            config, model = EngineConfig(model=model, **engine_args), None
        # Offline: the LLM class's default limits (larger steps on large GPUs; resolve_limits).
        self.engine = LLMEngine(config, model=model, progress=progress,
                                usage_context="llm_class")
        self.engine.stream_outputs = False  # generate() only collects finished requests
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 priority: Sequence[int] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for every prompt (text, token ids, or ``{"prompt_token_ids": [...]}``);
        outputs come back in prompt order."""
        items = self._normalise(prompts, prompt_token_ids)
        params = self._per_prompt(sampling_params, len(items), SamplingParams)
        return self._add_and_run(items, params, priority, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt] | None = None,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
              prompt_token_ids: Sequence[Sequence[int]] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``), pooled from the model's final
        hidden states (:class:`PoolingParams`: last token or mean, normalized by default);
        batched with any other work in the engine, in prompt order."""
        items = self._normalise(prompts, prompt_token_ids)
        params = self._per_prompt(pooling_params, len(items), PoolingParams)
        return self._add_and_run(items, params, None, use_tqdm)

    def _add_and_run(self, items, params, priority, use_tqdm: bool) -> list:
        priorities = list(priority) if priority is not None else [0] * len(items)
        if len(priorities) != len(items):
            raise ValueError(f"got {len(priorities)} priorities for {len(items)} prompts")
        request_ids = []
        try:
            for (text, ids), p, prio in zip(items, params, priorities, strict=True):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, text, p, prompt_token_ids=ids,
                                        priority=prio)
                request_ids.append(request_id)
        except ValueError:
            self.engine.abort_request(request_ids)  # leave nothing half-queued
            raise
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, use_tqdm: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to each conversation, then generates."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or tokenizer.chat_template is None:
            raise ValueError("this model has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_ids = []
        for conversation in conversations:
            rendered = tokenizer.apply_chat_template(
                list(conversation), add_generation_prompt=add_generation_prompt,
                tokenize=False, **(chat_template_kwargs or {}))
            # The template already holds any special tokens; don't add them twice.
            token_ids.append(tokenizer(rendered, add_special_tokens=False)["input_ids"])
        return self.generate(prompt_token_ids=token_ids, sampling_params=sampling_params,
                             use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list:
        from tqdm.auto import tqdm

        wanted = set(request_ids)
        finished: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
        # the engine's start-up heap out of the run's full collections (vLLM's engine core
        # freezes it too)
        with gc_watch.frozen_heap(), tqdm(total=len(request_ids), desc="Processed prompts",
                                          disable=not use_tqdm, unit="req") as bar:
            while len(finished) < len(wanted):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("engine went idle with requests unfinished")
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[r] for r in request_ids]

    @staticmethod
    def _normalise(prompts, prompt_token_ids) -> list[tuple[str | None, list[int] | None]]:
        if prompt_token_ids is not None:
            if prompts is not None:
                raise ValueError("pass prompts or prompt_token_ids, not both")
            return [(None, list(ids)) for ids in prompt_token_ids]
        if prompts is None:
            raise ValueError("no prompts given")
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        items = []
        for p in prompts:
            if isinstance(p, str):
                items.append((p, None))
            elif isinstance(p, dict) and "prompt_token_ids" in p:
                items.append((p.get("prompt"), list(p["prompt_token_ids"])))
            elif isinstance(p, dict) and "prompt" in p:
                items.append((p["prompt"], None))
            elif isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
                items.append((None, list(p)))
            else:
                raise ValueError(f"unsupported prompt {p!r}: give a string, a list of token "
                                 "ids, or {'prompt_token_ids': [...]}")
        return items

    @staticmethod
    def _per_prompt(params, count: int, kind: type) -> list:
        if params is None:
            return [kind()] * count
        if isinstance(params, kind):
            return [params] * count
        params = list(params)
        if len(params) != count or not all(isinstance(p, kind) for p in params):
            raise ValueError(f"give one {kind.__name__} or a list of {count} (one per prompt)")
        return params
