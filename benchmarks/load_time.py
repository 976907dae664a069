"""Loading one model's weights from a Hugging Face safetensors directory, from its orbax
conversion (``jaxllm convert``) and as dummy weights of its shape: the time of
``load_model`` (params on the device, blocked on) for each, each format in a fresh process,
loaded ``--repeats`` times there so the last is a warm page cache (issue 16's warm restart).

Formats (``--formats``):

- ``hf``: the directory's safetensors, as the engine loads them (float leaves made on the
  device from the stored rows: :mod:`jaxllm.loading.device_blocks`);
- ``hf-host``: the same, every block made on the host instead (``Leaf.read``, the path before
  the device-side one; the spec it is tested against);
- ``orbax``: ``--orbax DIR``, or the directory converted into a temporary one first (its
  time printed);
- ``dummy``: random weights of the directory's config.json.

    python -m jaxllm.benchmarks.write_checkpoint llama-3-8b /tmp/llama-3-8b-hf
    python -m jaxllm.benchmarks.load_time /tmp/llama-3-8b-hf --dtype bfloat16 \\
        --output-json /tmp/load_time.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from jaxllm.benchmarks.provenance import source_commit, write_json

FORMATS = ("hf", "hf-host", "orbax", "dummy")


def _blocks_made_on_the_host() -> None:
    """Makes ``assemble_params`` (this process's) build every block on the host
    (``Leaf.read``), as the loader did before :mod:`jaxllm.loading.device_blocks`."""
    import dataclasses

    import jax

    from jaxllm.loading import assemble

    def host_only(leaf):
        if isinstance(leaf, assemble.StackedLeaf):
            return dataclasses.replace(leaf, layers=tuple(map(host_only, leaf.layers)))
        return dataclasses.replace(leaf, put=None)

    materialize = assemble.materialize

    def host_materialize(leaves, *args, **kwargs):
        leaves = jax.tree.map(host_only, leaves, is_leaf=lambda x: isinstance(x, assemble.Leaf))
        return materialize(leaves, *args, **kwargs)

    assemble.materialize = host_materialize


def load_once(args: argparse.Namespace) -> dict:
    """The child: ``--repeats`` loads of one format in this process, as JSON on stdout."""
    import jax

    from jaxllm.engine.engine_config import resolve_unroll_layers
    from jaxllm.loading import load_model

    unroll = resolve_unroll_layers(args.unroll_layers, jax.default_backend())
    if args.format == "hf-host":
        _blocks_made_on_the_host()
    model, load_format = args.path, {"dummy": "dummy", "orbax": "orbax"}.get(args.format, "auto")
    if args.format == "dummy":
        model = os.path.join(args.path, "config.json")
    seconds, profile = [], None
    for repeat in range(args.repeats):
        last = repeat == args.repeats - 1
        profiler = cProfile.Profile() if args.profile and last else None
        began = time.perf_counter()
        if profiler:
            profiler.enable()
        loaded = load_model(model, dtype=args.dtype, load_format=load_format,
                            unroll_layers=unroll, tensor_parallel_size=args.tensor_parallel_size)
        jax.block_until_ready(loaded.params)
        if profiler:
            profiler.disable()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(12)
            profile = out.getvalue()
        seconds.append(time.perf_counter() - began)
        from jaxllm.engine.device_memory import stored_bytes
        nbytes = sum(stored_bytes(x) for x in jax.tree.leaves(loaded.params))
        del loaded
    # Peak resident memory of this process: on CPU it includes the params themselves, and
    # the mapped checkpoint pages that were read.
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"format": args.format, "seconds": seconds, "param_bytes": nbytes,
            "max_rss_bytes": max_rss,
            "unroll_layers": unroll, "device": str(jax.devices()[0].device_kind),
            "profile": profile}


def _child(args: argparse.Namespace, fmt: str, path: str) -> dict:
    command = [sys.executable, "-m", "jaxllm.benchmarks.load_time", path, "--child", fmt,
               "--dtype", args.dtype, "--repeats", str(args.repeats),
               "--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.unroll_layers is not None:
        command.append("--unroll-layers" if args.unroll_layers else "--no-unroll-layers")
    if args.profile:
        command.append("--profile")
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"loading {fmt} failed")
    return {**json.loads(done.stdout.strip().splitlines()[-1]),
            "process_s": time.perf_counter() - began}


def _convert(args: argparse.Namespace, out: str) -> float:
    command = [sys.executable, "-m", "jaxllm", "convert", args.path, out, "--dtype", args.dtype]
    if args.unroll_layers is not None:
        command.append("--unroll-layers" if args.unroll_layers else "--no-unroll-layers")
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit("jaxllm convert failed")
    return time.perf_counter() - began


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a Hugging Face safetensors directory")
    parser.add_argument("--formats", default="hf,orbax,dummy",
                        help=f"comma-separated, of {', '.join(FORMATS)}")
    parser.add_argument("--orbax", default=None, help="its `jaxllm convert` (default: made now)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--unroll-layers", action=argparse.BooleanOptionalAction, default=None,
                        help="default: the engine's (per-layer on GPU, stacked on CPU)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="loads per process; the last "
                        "is reported (a warm page cache)")
    parser.add_argument("--profile", action="store_true", help="cProfile the last load")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.format = args.child
        print(json.dumps(load_once(args)))
        return 0
    formats = args.formats.split(",")
    if unknown := set(formats) - set(FORMATS):
        parser.error(f"--formats: unknown {sorted(unknown)} (of {', '.join(FORMATS)})")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be >= 1")
    if not os.path.isfile(os.path.join(args.path, "config.json")):
        parser.error(f"{args.path}: not a Hugging Face directory (no config.json)")
    scratch = tempfile.mkdtemp(prefix="jaxllm-load-time-")
    try:
        convert_s = None
        if "orbax" in formats and args.orbax is None:
            args.orbax = os.path.join(scratch, "orbax")
            convert_s = _convert(args, args.orbax)
            print(f"jaxllm convert: {convert_s:.1f} s", flush=True)
        runs = []
        print(f"{'format':>8} | {'GiB':>6} | {'last load s':>11} | {'each load s':<24} | "
              "process s | peak RSS GiB", flush=True)
        for fmt in formats:
            run = _child(args, fmt, args.orbax if fmt == "orbax" else args.path)
            runs.append(run)
            print(f"{fmt:>8} | {run['param_bytes'] / 2**30:6.2f} | {run['seconds'][-1]:11.2f} "
                  f"| {', '.join(f'{s:.2f}' for s in run['seconds']):<24} | "
                  f"{run['process_s']:9.1f} | {run['max_rss_bytes'] / 2**30:.2f}", flush=True)
        for run in runs:
            if run["profile"]:
                print(f"--- {run['format']}: cProfile of the last load\n{run['profile']}")
        write_json({"benchmark": "load_time", "commit": source_commit(),
                    "args": {k: v for k, v in vars(args).items() if k != "child"},
                    "convert_s": convert_s, "runs": runs}, args.output_json)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
