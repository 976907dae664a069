"""The host cost of streamed outputs: cumulative vs delta (``RequestOutputKind``).

Runs ``--requests`` requests of ``--output-len`` tokens (EOS ignored) through one engine with
streamed outputs (as the server runs it), once with CUMULATIVE outputs (each step copies every
running request's whole output and joins its text) and once with DELTA outputs (each step
only what is new), on a random model of ``--model``'s shape with the embedded SmolLM2's
tokenizer, and prints the engine's output phase per step for each.

    python -m jaxllm.benchmarks.output_kinds --requests 32 --output-len 1024
"""

from __future__ import annotations

import argparse
import json
import time


def run_kind(engine, kind, args) -> dict:
    from jaxllm import SamplingParams

    stats = engine.stats
    before = (stats.output_seconds, stats.num_steps)
    start = time.perf_counter()
    for i in range(args.requests):
        engine.add_request(f"{kind.name}-{i}", prompt_token_ids=[10 + i, 11, 12],
                           params=SamplingParams(temperature=1.0, seed=i, ignore_eos=True,
                                                 max_tokens=args.output_len, output_kind=kind))
    copied = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            copied += sum(len(o.token_ids) for o in out.outputs)
    steps = stats.num_steps - before[1]
    return {"kind": kind.name, "steps": steps, "seconds": time.perf_counter() - start,
            "output_ms_per_step": 1e3 * (stats.output_seconds - before[0]) / steps,
            "token_ids_in_outputs": copied}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    import jax.numpy as jnp

    import jaxllm
    from jaxllm import EngineConfig, LLMEngine, RequestOutputKind
    from jaxllm.loading import LoadedModel
    from jaxllm.loading.dummy import dummy_params

    real = jaxllm.load_model(None, dtype="float32")
    cfg = jaxllm.ModelConfig(vocab_size=real.config.vocab_size, hidden_size=64,
                             intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=args.output_len + 16,
                             eos_token_ids=real.config.eos_token_ids)
    model = LoadedModel("tiny-smollm2-vocab", cfg, dummy_params(cfg, jnp.float32, seed=0),
                        real.tokenizer, jnp.float32)
    engine = LLMEngine(EngineConfig(max_num_seqs=args.requests,
                                    max_num_batched_tokens=max(256, args.requests),
                                    max_model_len=args.output_len + 16), model=model,
                       progress=False)
    results = [run_kind(engine, kind, args)
               for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA)]
    for r in results:
        print(f"{r['kind']:10s} {r['steps']} steps, {r['seconds']:.2f} s, output phase "
              f"{r['output_ms_per_step']:.3f} ms a step, {r['token_ids_in_outputs']:,} token "
              "ids copied into outputs")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
