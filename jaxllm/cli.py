"""The ``jaxllm`` command line. Subcommands: ``generate`` (one prompt, one reply), ``convert``
(a model as an orbax checkpoint in the engine's precision and layout), ``serve`` (the
OpenAI-compatible server, ``python -m jaxllm.serve``) and ``bench``
(``python -m jaxllm.benchmarks``)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from jaxllm.errors import JaxLLMError
from jaxllm.quantization.config import QUANTIZATION_NAMES

DEFAULT_PROMPT = "What are three good reasons to learn a second language?"


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face model directory or .gguf file (default: the embedded "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
    parser.add_argument("--load-format", default="auto",
                        choices=["auto", "safetensors", "gguf", "dummy", "orbax"])
    parser.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32, 64, 128])
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="shard the model over this many local devices")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="split the layers into this many stages, each over its own "
                             "--tensor-parallel-size devices")
    parser.add_argument("--quantization", "-q", default=None,
                        choices=QUANTIZATION_NAMES,
                        help="int8 weight-only or fp8 W8A8: quantized at load time; awq, gptq: "
                             "a 4-bit checkpoint's own (read from its quantization_config "
                             "without the flag)")
    parser.add_argument("--seed", type=int, default=0,
                        help="sampling seed (the engine's SamplingParams.seed: the same tokens as "
                             "LLM and the server draw with it); also seeds dummy weights")


def _check_sampling_args(args: argparse.Namespace) -> None:
    """vLLM's ranges (SamplingParams'), named by their flags."""
    checks = [
        (args.max_tokens >= 1, f"--max-tokens={args.max_tokens} must be >= 1"),
        (args.temperature >= 0, f"--temperature={args.temperature} must be >= 0"),
        (args.top_k >= -1, f"--top-k={args.top_k} must be >= 1, or 0 or -1 (off)"),
        (0 < args.top_p <= 1, f"--top-p={args.top_p} must be in (0, 1]"),
        (0 <= args.min_p <= 1, f"--min-p={args.min_p} must be in [0, 1]"),
        (0 < args.repetition_penalty <= 2,
         f"--repetition-penalty={args.repetition_penalty} must be in (0, 2]"),
        (-2 <= args.presence_penalty <= 2,
         f"--presence-penalty={args.presence_penalty} must be in [-2, 2]"),
        (-2 <= args.frequency_penalty <= 2,
         f"--frequency-penalty={args.frequency_penalty} must be in [-2, 2]"),
    ]
    for ok, message in checks:
        if not ok:  # NaN fails every comparison, so it lands here too
            raise JaxLLMError(message)


def _generate(args: argparse.Namespace) -> int:
    import functools

    import jax
    import jax.numpy as jnp

    from jaxllm.generate import generate
    from jaxllm.loading import load_model
    from jaxllm.quantization.compile_options import forward_compiler_options

    _check_sampling_args(args)
    start = time.perf_counter()
    model = load_model(args.model, dtype=args.dtype, load_format=args.load_format,
                       seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
                       pipeline_parallel_size=args.pipeline_parallel_size,
                       quantization=args.quantization)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise JaxLLMError("this model has no tokenizer, so it cannot take a text prompt")
    use_chat = tokenizer.chat_template is not None and not args.no_chat_template
    if use_chat:
        messages = [{"role": "user", "content": args.prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
    else:
        ids = tokenizer(args.prompt)["input_ids"]
    if not ids:
        raise JaxLLMError("the prompt is empty after tokenization")
    if len(ids) + args.max_tokens > model.config.max_position_embeddings:
        raise JaxLLMError(
            f"prompt ({len(ids)} tokens) + --max-tokens ({args.max_tokens}) exceeds the model's "
            f"context length {model.config.max_position_embeddings}")
    loaded = time.perf_counter()
    call_args = (model.params, jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32),
                 jax.random.key(args.seed))
    # The settings are Python numbers in the closure: generate() compiles the cheapest sampler
    # variant for them (no vocabulary sort without top-k/top-p, no counts without penalties).
    call = functools.partial(
        generate, config=model.config, max_new_tokens=args.max_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed,
        eos_token_ids=() if args.ignore_eos else model.config.eos_token_ids,
        block_size=args.block_size, pad_token_id=tokenizer.pad_token_id or 0, mesh=model.mesh)
    compiled = jax.jit(call).lower(*call_args).compile(
        compiler_options=forward_compiler_options(model.quantization))
    compiled_at = time.perf_counter()
    out = compiled(*call_args)
    n = int(out.num_tokens[0])
    tokens = jax.device_get(out.tokens[0, :n]).tolist()
    done = time.perf_counter()
    print(tokenizer.decode(tokens, skip_special_tokens=True).strip())
    print(f"\n[{model.name}, {jax.default_backend()}, {model.dtype.name}] prompt {len(ids)} "
          f"tokens, generated {n} tokens in {done - compiled_at:.2f} s "
          f"({n / (done - compiled_at):.1f} tokens/s); load {loaded - start:.1f} s, "
          f"compile {compiled_at - loaded:.1f} s", file=sys.stderr)
    return 0


def _convert(args: argparse.Namespace) -> int:
    import jax

    import jaxllm
    from jaxllm.engine.engine_config import resolve_unroll_layers
    from jaxllm.loading.orbax_checkpoint import save_converted

    start = time.perf_counter()
    model = jaxllm.load_model(
        None if args.model == "default" else args.model, dtype=args.dtype,
        load_format=args.load_format, quantization=args.quantization,
        unroll_layers=resolve_unroll_layers(args.unroll_layers, jax.default_backend()))
    loaded = time.perf_counter()
    save_converted(model, args.output)
    from jaxllm.engine.device_memory import stored_bytes
    size = sum(stored_bytes(x) for x in jax.tree.leaves(model.params))
    print(f"{args.output}: {model.name}, {jax.numpy.dtype(model.dtype).name}, "
          f"{model.quantization.describe() if model.quantization else 'not quantized'}, "
          f"{'per-layer' if model.unroll_layers else 'stacked'} layers, {size / 2**30:.2f} GiB "
          f"of params (loaded in {loaded - start:.1f} s, written in "
          f"{time.perf_counter() - loaded:.1f} s); serve it with `jaxllm serve {args.output}`")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a reply to one prompt and print it")
    _add_model_args(gen)
    gen.add_argument("--prompt", default=DEFAULT_PROMPT)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 or -1 = off")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0,
                     help="drop tokens below min_p x the most likely one's probability")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="> 1 discourages tokens of the prompt and the output; 1 = off")
    gen.add_argument("--presence-penalty", type=float, default=0.0,
                     help="subtracted once from each token already in the output")
    gen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="subtracted per occurrence of a token in the output")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--no-chat-template", action="store_true",
                     help="feed the prompt as raw text instead of a chat message")
    gen.set_defaults(handler=_generate)
    conv = sub.add_parser(
        "convert", help="write a model as an orbax checkpoint already in the engine's "
                        "precision and layer layout (`jaxllm serve OUT` / LLM(OUT) load it)")
    conv.add_argument("model", help="Hugging Face model directory or .gguf file; `default` for "
                                    "the embedded SmolLM2-135M-Instruct")
    conv.add_argument("output", help="a new (or empty) directory")
    conv.add_argument("--dtype", default="auto",
                      choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
    conv.add_argument("--load-format", default="auto",
                      choices=["auto", "safetensors", "gguf", "dummy"],
                      help="dummy: random weights of MODEL's shape (a preset such as "
                           "llama-3-8b, or a config.json), e.g. to time loading and start-up")
    conv.add_argument("--quantization", "-q", default=None, choices=["int8", "fp8"],
                      help="quantize while converting (int8 weight-only, fp8 W8A8)")
    conv.add_argument("--unroll-layers", action=argparse.BooleanOptionalAction, default=None,
                      help="per-layer params (the GPU engine's layout) or stacked (CPU's); "
                           "default: what the engine on this machine runs")
    conv.set_defaults(handler=_convert)
    # Listed for --help only: main() hands `jaxllm serve ...` to `python -m jaxllm.serve ...`.
    sub.add_parser("serve", add_help=False,
                   help="serve a model behind an OpenAI-compatible HTTP API (see "
                        "`jaxllm serve --help`)")
    # Likewise: main() hands `jaxllm bench ...` to the benchmarks package.
    sub.add_parser("bench", add_help=False,
                   help="benchmarks: throughput, serve, latency (see `jaxllm bench --help`)")
    return parser


def _bench(argv: list[str]) -> int:
    """``jaxllm bench ...`` = ``python -m jaxllm.benchmarks ...``. Imported here, not at module
    import: the benchmarks sit above the engine (they import it, never the reverse)."""
    from jaxllm.benchmarks.__main__ import main as bench_main

    return bench_main(argv, prog="jaxllm bench")


def _serve(argv: list[str]) -> None:
    """Replaces this process with ``python -m jaxllm.serve ARGS``: the server sits a layer
    above the engine (it imports the engine, never the reverse), and signals reach it
    directly."""
    os.execv(sys.executable, [sys.executable, "-m", "jaxllm.serve", *argv])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        _serve(argv[1:])
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (JaxLLMError, ValueError) as e:
        print(f"jaxllm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
