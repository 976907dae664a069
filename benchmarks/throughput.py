"""``bench throughput``: offline generation throughput, several backends on identical prompts.

    python -m jaxllm.benchmarks throughput --model llama-3-8b --load-format dummy \\
        --dtype bfloat16 --dataset-name sharegpt-like --num-prompts 1000 \\
        --backend jaxllm,hf-tuned --devices 0,1

Every backend samples at temperature 1 with fixed output lengths, EOS ignored, as vLLM's
``benchmark_throughput.py``; compilation and warm-up happen before the clock starts.

- ``jaxllm``: :class:`~jaxllm.LLMEngine` (paged KV cache, continuous batching) with the engine
  flags given here.
- ``jax-static``: :func:`jaxllm.generate` on static batches of ``--jax-static-batch-size`` (default
  ``--max-num-seqs``) prompts in the given order: one jitted prefill + decode loop per batch over a
  private pool in which each row owns a contiguous run of ``width + capacity`` slots (a contiguous
  per-sequence cache); one compiled shape for all batches: width = the longest prompt rounded up to
  128, capacity = the longest output rounded up to 16; short batches padded with dummy rows. Every
  row decodes the batch's longest output (``row_max_new_tokens``).
- ``hf``: vLLM's ``--backend hf`` (what vLLM's own ratios are against): transformers
  ``generate()`` on static batches of ``--hf-max-batch-size`` prompts in the given order, dynamic
  cache (:mod:`benchmarks.hf_backend`).
- ``hf-tuned``: a tuned static-batching transformers: prompts sorted by length into batches, sdpa
  attention, a static cache compiled with ``torch.compile`` on CUDA (``--hf-tuned-cache``;
  :mod:`benchmarks.hf_tuned` says why for both workloads).
- ``hf-cb``: transformers' own continuous batching (the manager behind ``generate_batch``; paged
  cache, every request added at once with its own output length).

One definition each, for every backend:

- Output tokens are the tokens the backend produced, counted from what it returned (jaxllm: the
  finished outputs; jax-static: ``generate()``'s ``num_tokens``; hf variants: the returned ids,
  up to the first EOS), each row up to its requested length: a static batch's rows that decode
  past their own length do waste, not output. Throughput is produced tokens over timed seconds;
  a run whose count differs from the requested total fails (``TokenCountError``, after its JSON
  is written).
- KV waste and pool utilisation: :mod:`jaxllm.engine.kv_usage`, time-averaged over steps (waste
  = 1 - used / reserved slots, utilisation = reserved / pool slots; block tables vs tokens for
  jaxllm, the whole contiguous cache vs real tokens for jax-static and hf's static caches, rows x
  padded length for hf's dynamic cache). hf-cb: n/a, its block tables stay inside transformers.
- Peak memory: :mod:`benchmarks.device_memory`, device bytes in use sampled by a thread during
  the timed run (n/a on CPU). Extras beside it: ``planned_peak_bytes`` (held before the clock +
  the largest compiled step's temporaries), ``jax_peak_bytes_in_use`` (JAX's own peak, compile
  scratch included), ``allocator_peak_bytes`` (torch), ``host_peak_rss_bytes``.

With several backends, each runs in its own child process (clean device memory), and the parent
prints them side by side, each one's output tokens/s over every hf variant's (``ratios`` in the
JSON), and writes one JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

from jaxllm.benchmarks.datasets import Request, add_dataset_args, sample_requests
from jaxllm.benchmarks.device_memory import host_peak_rss_bytes
from jaxllm.benchmarks.hf_tuned import TUNED_CACHES
from jaxllm.benchmarks.metrics import TokenCountError, check_output_tokens
from jaxllm.benchmarks.provenance import source_commit

from jaxllm.quantization.config import QUANTIZATION_NAMES

HF_BACKENDS = ("hf", "hf-tuned", "hf-cb")
BACKENDS = ("jaxllm", *HF_BACKENDS, "jax-static")

_HF_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                   "Qwen2ForCausalLM": "qwen2"}


def _batch_size(text: str) -> int:
    """A static batch size given on the command line: an integer >= 1."""
    size = int(text)
    if size < 1:
        raise argparse.ArgumentTypeError(f"{size} must be >= 1")
    return size


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="jaxllm",
                        help=f"one or a comma-separated list of {', '.join(BACKENDS)}")
    m = parser.add_argument_group("model")
    m.add_argument("--model", default=None, help="a preset (jaxllm.presets, with --load-format "
                   "dummy), HF directory, config.json (dummy) or .gguf; default: embedded SmolLM2")
    m.add_argument("--load-format", default="auto",
                   choices=["auto", "safetensors", "gguf", "dummy"])
    m.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
    m.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_NAMES,
                   help="jaxllm and jax-static: int8 weight-only or fp8 W8A8 quantized at load "
                   "time (dummy weights too); awq, gptq: a 4-bit checkpoint's own")
    e = parser.add_argument_group("engine (jaxllm; --max-num-seqs is also jax-static's batch "
                                  "unless --jax-static-batch-size)")
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="jaxllm: the KV pool's dtype (fp8: half the bytes of bf16)")
    e.add_argument("--num-gpu-blocks-override", type=int, default=None)
    e.add_argument("--unroll-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="unrolled layer stack over a per-layer KV pool, for jaxllm and "
                   "jax-static (default: on GPU, as the engine)")
    e.add_argument("--enforce-eager", action="store_true")
    e.add_argument("--attention-backend", default="auto",
                   help="jaxllm: as `jaxllm serve --attention-backend` (pallas_mosaic: the "
                   "Hopper prefill kernel)")
    e.add_argument("--enable-prefix-caching", action="store_true")
    e.add_argument("--structured-fraction", type=float, default=0.0,
                   help="share of the requests (every k-th) whose output is constrained to "
                        "STRUCTURED_SCHEMA (structured outputs; needs a tokenizer)")
    e.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json for a model without one (dummy presets); grammars "
                        "index its vocabulary")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="jaxllm and jax-static: shard the model over this many devices")
    e.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="jaxllm and jax-static: split the layers into this many stages, each "
                   "over its own --tensor-parallel-size devices")
    e.add_argument("--jax-static-batch-size", type=_batch_size, default=None,
                   help="jax-static's static batch (default: --max-num-seqs, else 256); its "
                   "contiguous cache holds batch x (longest prompt + longest output) tokens, "
                   "so an MHA model needs a smaller batch than the engine runs")
    h = parser.add_argument_group("hf, hf-tuned, hf-cb")
    h.add_argument("--hf-python", default=sys.executable,
                   help="interpreter with torch + transformers (default: this one)")
    h.add_argument("--hf-max-batch-size", type=_batch_size, default=None,
                   help="hf and hf-tuned: static batch size (default: --max-num-seqs, else "
                   "256); hf-cb: its max_requests_per_batch (default: transformers' choice)")
    h.add_argument("--hf-tuned-cache", choices=TUNED_CACHES, default="auto",
                   help="hf-tuned's KV cache: static-compile (a static cache, decode compiled by "
                   "torch.compile; auto on CUDA), static (eager), dynamic (auto elsewhere)")
    h.add_argument("--hf-devices", default=None,
                   help="comma-separated GPU ids: hf's static batches dealt round-robin to one "
                   "process per GPU, run at the same time; its time is the sum of theirs (what "
                   "one GPU would take), so a long hf baseline fits in less wall time")
    parser.add_argument("--devices", default=None,
                        help="comma-separated GPU ids: backend i runs on device i %% count, "
                        "backends on different devices at the same time (e.g. 0,1: jaxllm and "
                        "hf side by side on a two-GPU machine)")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--plot", action="store_true", help="bar chart of output tokens/s (next "
                        "to --output-json, else in benchmarks/results/)")
    parser.add_argument("--no-progress", action="store_true")
    add_dataset_args(parser)


def model_config(args):
    """The ModelConfig, without loading weights (the hf backend needs only the shape)."""
    from jaxllm.model_config import ModelConfig
    from jaxllm.presets import PRESETS

    if args.model in PRESETS and args.load_format == "dummy":
        return PRESETS[args.model]
    path = args.model or ""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not path.endswith(".json") or not os.path.isfile(path):
        raise ValueError("the hf backend needs --model as a preset name (with --load-format "
                         "dummy), a Hugging Face directory or a config.json")
    with open(path) as f:
        return ModelConfig.from_hf_config(json.load(f))


def hf_config_dict(cfg) -> dict:
    """A transformers config of the same shape (random weights are drawn from it)."""
    out = dict(model_type=_HF_MODEL_TYPES[cfg.architecture], architectures=[cfg.architecture],
               vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
               intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
               num_attention_heads=cfg.num_attention_heads,
               num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
               rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
               max_position_embeddings=cfg.max_position_embeddings,
               tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id,
               eos_token_id=list(cfg.eos_token_ids))
    if cfg.architecture == "LlamaForCausalLM":
        out["attention_bias"] = cfg.attention_bias
    if cfg.sliding_window is not None:
        out["sliding_window"] = cfg.sliding_window
    return out


def run_one(backend: str, args) -> dict:
    """Runs one backend in this process and returns its result dict; ``token_count_error`` is
    set when it produced another number of output tokens than the workload asked for."""
    if backend in HF_BACKENDS:
        from jaxllm.benchmarks.hf_backend import run_hf

        cfg = model_config(args)
        requests = _requests(args, cfg)
        real = args.load_format != "dummy" and args.model is not None \
            and os.path.isdir(args.model)
        extra = run_hf(requests, variant=backend, hf_python=args.hf_python,
                       model=args.model if real else None,
                       hf_config=None if real else hf_config_dict(cfg), dtype=args.dtype,
                       batch_size=args.hf_max_batch_size or args.max_num_seqs or 256,
                       cb_max_requests=args.hf_max_batch_size, tuned_cache=args.hf_tuned_cache,
                       n=args.n, seed=args.seed, progress=not args.no_progress,
                       devices=[d.strip() for d in (args.hf_devices or "").split(",")
                                if d.strip()] or None)
        name = args.model
    else:
        import jax

        model = load_jax_model(args)
        requests = _requests(args, model.config)
        from jaxllm.benchmarks.jax_backends import run_jax_static, run_jaxllm

        run = run_jaxllm if backend == "jaxllm" else run_jax_static
        extra = run(model, requests, args)
        stats = jax.local_devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:  # JAX's own peak: compile scratch (autotuning) too
            extra["jax_peak_bytes_in_use"] = int(stats["peak_bytes_in_use"])
        extra["host_peak_rss_bytes"] = host_peak_rss_bytes()
        extra["device"] = jax.devices()[0].device_kind
        name = model.name
    elapsed = extra.pop("elapsed_s")
    prompt_tokens = sum(r.prompt_len for r in requests)
    requested = sum(r.output_len for r in requests) * args.n
    output_tokens = extra.pop("generated_tokens")  # counted from what the backend returned
    try:
        if not getattr(args, "structured_fraction", 0):  # a finished JSON ends its request
            check_output_tokens(backend, output_tokens, requested)
        error = {}
    except TokenCountError as e:
        error = {"token_count_error": str(e)}
    return {"backend": backend, "model": name, "elapsed_time": elapsed,
            "num_requests": len(requests), "total_prompt_tokens": prompt_tokens,
            "total_output_tokens": output_tokens, "requested_output_tokens": requested,
            "requests_per_second": len(requests) / elapsed,
            "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
            "output_tokens_per_second": output_tokens / elapsed, **error, **extra}


def load_jax_model(args):
    """The model the JAX backends run, as the flags describe it (with ``--tokenizer``'s)."""
    import jax

    import jaxllm
    from jaxllm.engine.engine_config import resolve_unroll_layers

    pp = getattr(args, "pipeline_parallel_size", 1)  # step_profile has no such flag
    # jaxllm's engine and jax-static's generate() both run the layer layout loaded here
    # (unrolled: per-layer params over a per-layer pool), so no second copy is made.
    model = jaxllm.load_model(
        args.model, dtype=args.dtype, load_format=args.load_format, seed=args.seed,
        unroll_layers=resolve_unroll_layers(args.unroll_layers, jax.default_backend()),
        tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
        pipeline_parallel_size=pp,
        tokenizer=args.tokenizer)
    return model


def _requests(args, cfg) -> list[Request]:
    return sample_requests(args.dataset_name, args.num_prompts, cfg.vocab_size, seed=args.seed,
                           input_len=args.input_len, output_len=args.output_len,
                           range_ratio=args.range_ratio,
                           max_model_len=args.max_model_len or cfg.max_position_embeddings)


def _child_argv(argv: list[str], backend: str, out: str) -> list[str]:
    """``argv`` with --backend / --output-json / --plot replaced for one child run."""
    keep, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--backend", "--output-json"):
            skip = True
            continue
        if a.startswith(("--backend=", "--output-json=")) or a == "--plot":
            continue
        keep.append(a)
    return [*keep, "--backend", backend, "--output-json", out]


def _print(result: dict) -> None:
    peak = result.get("peak_memory_bytes")
    pct = lambda key: "n/a" if result.get(key) is None else f"{result[key]:.1%}"
    print(f"[{result['backend']}] Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, "
          f"{result['output_tokens_per_second']:.2f} output tokens/s "
          f"({result['total_output_tokens']} output tokens produced); peak memory "
          f"{'' if peak is None else f'{peak / 2**30:.2f} GiB '}"
          f"({result.get('peak_memory_kind', 'n/a')}); KV waste {pct('kv_waste')}, pool "
          f"utilisation {pct('kv_pool_utilisation')}; warm-up "
          f"{result.get('warm_up_s') or 0:.1f} s, timed {result['elapsed_time']:.1f} s")
    if "token_count_error" in result:
        print(f"[{result['backend']}] ERROR: {result['token_count_error']}")
    if "step_phases_ms" in result:
        ms = result["step_phases_ms"]
        host = ms["schedule_ms"] + ms["prepare_ms"] + ms["update_ms"]
        print(f"[{result['backend']}] {result['steps']} steps, {result['step_ms']:.2f} ms each: "
              f"host critical path {host:.2f} ms (schedule {ms['schedule_ms']:.2f}, prepare "
              f"{ms['prepare_ms']:.2f}, update {ms['update_ms']:.2f}), overlapped output "
              f"{ms['output_ms']:.2f} ms, waiting on the device {ms['device_wait_ms']:.2f} ms")


def _run_children(backends: list[str], args, tmp: str) -> dict:
    """Each backend in its own child process. With ``--devices``, backend i runs on device
    ``devices[i % len(devices)]`` (CUDA_VISIBLE_DEVICES): backends on different devices run at
    the same time, those sharing one run one after another."""
    devices = [d.strip() for d in (args.devices or "").split(",") if d.strip()] or [None]
    queues: dict = {}
    for i, b in enumerate(backends):
        queues.setdefault(devices[i % len(devices)], []).append(b)

    def run_queue(device, queue) -> dict:
        done = {}
        for b in queue:
            # Next to --output-json when given, so finished backends survive a later crash.
            out = (os.path.splitext(os.path.abspath(args.output_json))[0] + f".{b}.json"
                   if args.output_json else os.path.join(tmp, f"{b}.json"))
            env = dict(os.environ) | ({} if device is None else {"CUDA_VISIBLE_DEVICES": device})
            cmd = [sys.executable, "-m", "jaxllm.benchmarks", "throughput",
                   *_child_argv(args.argv, b, out)]
            rc = subprocess.run(cmd, cwd=_repo_root(), env=env).returncode
            try:  # a wrong token count still writes its JSON (and exits non-zero)
                with open(out) as f:
                    done[b] = json.load(f)["results"][b]
            except (OSError, ValueError, KeyError):
                done[b] = None
            if done[b] is None or (rc != 0 and "token_count_error" not in done[b]):
                raise RuntimeError(f"backend {b} failed (exit code {rc}); its output is above")
        return done

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(queues)) as pool:
        futures = [pool.submit(run_queue, d, q) for d, q in queues.items()]
        finished = {}
        for f in futures:
            finished |= f.result()
    return {b: finished[b] for b in backends}


def run(args: argparse.Namespace) -> dict:
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            raise ValueError(f"--backend {b!r} must be one of {BACKENDS}")
    if len(backends) == 1:
        results = {backends[0]: run_one(backends[0], args)}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            results = _run_children(backends, args, tmp)
    if len(backends) > 1:
        print("=" * 30, "side by side", "=" * 30)
    for r in results.values():
        _print(r)
    ratios = {f"{b}/{h}": results[b]["output_tokens_per_second"]
              / results[h]["output_tokens_per_second"]
              for h in results if h in HF_BACKENDS for b in results if b != h}
    for name, ratio in ratios.items():
        print(f"{name.replace('/', ' / ')} output tokens/s: {ratio:.2f}x")
    summary = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": source_commit(),
        "host": f"{platform.machine()}, {os.cpu_count()} cores",
        "args": {k: v for k, v in vars(args).items() if k not in ("handler", "argv")},
        "results": results, "ratios": ratios}
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=1)
    if args.plot:
        from jaxllm.benchmarks.plots import plot_bars

        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = (os.path.splitext(args.output_json)[0] + ".png" if args.output_json else
                os.path.join("benchmarks", "results",
                             f"throughput_{args.dataset_name}_{stamp}.png"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        plot_bars(results, "output_tokens_per_second", path,
                  f"{args.model or 'SmolLM2'}, {args.dataset_name}, {args.num_prompts} prompts")
        print(f"plot: {path}")
    errors = [r["token_count_error"] for r in results.values() if "token_count_error" in r]
    if errors:
        raise TokenCountError("; ".join(errors))
    return summary


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
