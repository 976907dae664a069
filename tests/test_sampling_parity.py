"""One sampler: the same prompt, seed and SamplingParams draw IDENTICAL token ids through
``jaxllm.generate``, ``LLM.generate`` and the server's ``/v1/completions`` (token-id and text
prompts), greedy, seeded with top-k/top-p/min-p, with penalties, and with min_tokens.

A tiny random model with SmolLM2's tokenizer; one engine serves the LLM phase, then the server.
Its embeddings are tied and scaled up, so it tends to repeat recent tokens (prompt ones
included) with clear margins: penalties change its greedy choices. Its EOS id is the first
greedy token of one prompt, so min_tokens has an EOS to ban."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.serve.args import ServerConfig
from jaxllm.serve.server import BackgroundServer
from tiny_models import TINY, random_params

import jaxllm
from jaxllm import LLM, AsyncLLMEngine, ModelConfig, SamplingParams
from jaxllm.loading import LoadedModel

MAX_TOKENS = 8
TOP = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, seed=7,
                     max_tokens=MAX_TOKENS)
# name -> (prompt, params); the same prompt for the last two (its first greedy token is EOS).
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
PENALTIES = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5)
CASES = {
    "greedy": ("1, 2, 3, 4, 5,", GREEDY),
    "greedy_penalties": ("1, 2, 3, 4, 5,", GREEDY.replace(**PENALTIES)),
    "top_k_top_p_min_p": ("Once upon a time,", TOP),
    "penalties": ("Once upon a time,", TOP.replace(  # a seed past 2**32 counts modulo 2**32
        top_k=0, top_p=1.0, min_p=0.0, seed=2**33 + 5, **PENALTIES)),
    "min_tokens": ("def fibonacci(n):", SamplingParams(temperature=0.0, min_tokens=3,
                                                       max_tokens=MAX_TOKENS)),
    "ignore_eos": ("def fibonacci(n):", SamplingParams(temperature=0.0, ignore_eos=True,
                                                       max_tokens=MAX_TOKENS)),
}
ROWS = tuple(CASES)[:-1]  # one batched generate() call


def padded(prompts: list[list[int]]) -> tuple[jax.Array, jax.Array]:
    ids = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    return jnp.asarray(ids), jnp.asarray([len(p) for p in prompts], jnp.int32)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="module")
def ids(tokenizer):
    return {name: tokenizer(prompt)["input_ids"] for name, (prompt, _) in CASES.items()}


@pytest.fixture(scope="module")
def generated(tokenizer, ids) -> tuple[LoadedModel, dict]:
    """The model (its EOS id chosen here) and name -> (token ids, raw logprobs) from
    jaxllm.generate."""
    cfg = ModelConfig(**TINY | {"vocab_size": len(tokenizer), "max_position_embeddings": 64},
                      tie_word_embeddings=True)
    params = random_params(cfg, seed=26)  # its first greedy digit-prompt token is a prompt token
    params = params | {"embed_tokens": {"embedding": 3 * params["embed_tokens"]["embedding"]}}
    # Python scalars: the static greedy variant. Its first token becomes the EOS id.
    out = jaxllm.generate(params, *padded([ids["ignore_eos"]]), jax.random.key(0), config=cfg,
                          max_new_tokens=MAX_TOKENS)
    results = {"ignore_eos": (np.asarray(out.tokens[0]).tolist(), np.asarray(out.logprobs[0]))}
    eos = results["ignore_eos"][0][0]
    model = LoadedModel("tiny", dataclasses.replace(cfg, eos_token_ids=(eos,)), params,
                        tokenizer, jnp.float32)
    # Per-row arrays: the general variant, one compilation for every other case.
    params = [CASES[name][1] for name in ROWS]
    column = lambda field, dtype: jnp.asarray([getattr(p, field) for p in params], dtype)
    out = jaxllm.generate(
        model.params, *padded([ids[name] for name in ROWS]), jax.random.key(0),
        config=model.config, max_new_tokens=MAX_TOKENS, eos_token_ids=(eos,),
        temperature=column("temperature", jnp.float32), top_k=column("top_k", jnp.int32),
        top_p=column("top_p", jnp.float32), min_p=column("min_p", jnp.float32),
        repetition_penalty=column("repetition_penalty", jnp.float32),
        presence_penalty=column("presence_penalty", jnp.float32),
        frequency_penalty=column("frequency_penalty", jnp.float32),
        min_tokens=column("min_tokens", jnp.int32),
        seed=jnp.asarray([(p.seed or 0) & 0xFFFFFFFF for p in params], jnp.uint32))
    for r, name in enumerate(ROWS):
        n = int(out.num_tokens[r])
        results[name] = (np.asarray(out.tokens[r, :n]).tolist(), np.asarray(out.logprobs[r, :n]))
    return model, results


def completion_body(prompt, params: SamplingParams) -> dict:
    fields = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
              "presence_penalty", "frequency_penalty", "seed", "min_tokens", "ignore_eos",
              "max_tokens")
    return {"model": "tiny", "prompt": prompt, "logprobs": 0,
            "return_tokens_as_token_ids": True,
            **{k: v for k, v in dataclasses.asdict(params).items() if k in fields}}


def post(url: str, body: dict) -> dict:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = json.loads(response.read())
    conn.close()
    assert response.status == 200, data
    return data["choices"][0]["logprobs"]


@pytest.fixture(scope="module")
def engine_runs(ids, generated):
    """(LLM.generate, server with token-id prompts, server with text) -> name -> token ids;
    plus the server's raw logprobs of the token-id requests."""
    llm = LLM(generated[0], max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
              enforce_eager=True, compilation_cache_dir=None, progress=False)
    outs = llm.generate([ids[name] for name in CASES], [p for _, p in CASES.values()],
                        use_tqdm=False)
    by_llm = {name: o.outputs[0].token_ids for name, o in zip(CASES, outs, strict=True)}
    config = ServerConfig(host="127.0.0.1", port=0, served_model_name=("tiny",),
                          disable_log_requests=True, disable_log_stats=True)
    with (BackgroundServer(AsyncLLMEngine(llm.engine), config) as server,
          concurrent.futures.ThreadPoolExecutor(2 * len(CASES)) as pool):
        as_ids = {name: pool.submit(post, server.url, completion_body(ids[name], params))
                  for name, (_, params) in CASES.items()}
        as_text = {name: pool.submit(post, server.url, completion_body(prompt, params))
                   for name, (prompt, params) in CASES.items()}
        as_ids = {name: f.result() for name, f in as_ids.items()}
        as_text = {name: f.result() for name, f in as_text.items()}
    token_ids = lambda lp: [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    return (by_llm, {name: token_ids(lp) for name, lp in as_ids.items()},
            {name: token_ids(lp) for name, lp in as_text.items()},
            {name: lp["token_logprobs"] for name, lp in as_ids.items()})


def test_the_cases_exercise_penalties_and_min_tokens(generated):
    model, results = generated
    eos, = model.config.eos_token_ids
    tokens = results["min_tokens"][0]
    assert tokens[0] != eos and len(tokens) >= 3  # greedy would have stopped at once
    # At the first step only prompt tokens are penalised: counting them matters.
    assert results["greedy_penalties"][0][0] != results["greedy"][0][0]


def test_llm_generate_draws_what_generate_draws(generated, engine_runs):
    expected = {name: tokens for name, (tokens, _) in generated[1].items()}
    assert engine_runs[0] == expected


def test_server_draws_what_generate_draws_for_token_id_and_text_prompts(generated,
                                                                        engine_runs):
    _, as_ids, as_text, logprobs = engine_runs
    expected = {name: tokens for name, (tokens, _) in generated[1].items()}
    assert as_ids == expected
    assert as_text == expected
    for name, (_, raw) in generated[1].items():  # generate()'s logprobs are the raw ones too
        np.testing.assert_allclose(logprobs[name], raw, atol=1e-4, err_msg=name)
