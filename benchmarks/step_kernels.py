"""``python -m jaxllm.benchmarks.step_kernels``: the kernels one engine step launches on an H200,
counted in its compiled program, and the temporaries it holds, on a machine without a GPU.

Why: small steps (batch-1 decode, the offline run's tail, AWQ and FP8 at a few rows) are bound
by launching their ~500-850 kernels (RESULTS.md: the AWQ batch-1 step's host time), and what
a change does to that count needs no device to see. XLA compiles for a described device
(deviceless compilation: a PJRT topology made from a ``GpuTargetConfig``, :data:`H200`), so
the engine's own step program (``step_programs``' forward, over the loader's dummy params as
shapes only) is compiled for sm_90a here as on the H200. Needs JAX's CUDA plugin installed
(``jax[cuda13]``; no driver, no GPU); run with ``JAX_PLATFORMS=cpu``.

What differs from the GPU's own compile: XLA cannot autotune without the device, so its GEMM
picks are heuristic (on the H200 the autotuner may choose cuBLAS where this shows a split-K
Triton GEMM and the reduction after it). The other kernels (norms, RoPE, the KV writes,
attention, quantization) come from the same HLO passes. Counted: every launch in the entry
computation (fusions, custom calls, copies; a ``while`` counts once), and XLA's temporaries
(``memory_analysis``: what the engine's KV planner subtracts from the device's memory), and
how the GPU executable submits them (``graph_structure``: XLA's thunk sequence, the command
buffers and the thunks launched outside them). ``readers`` (``input_readers`` in the JSON,
:func:`parameter_readers`): the launches that read the step's newly transferred batch, which
XLA re-records in the step's graph before it runs whenever that buffer moved (every step;
``JAXLLM_STAGE_STEP_INPUT=on`` leaves one).

``program_digest`` (in the JSON and the table) fingerprints the optimized program with what
only names the source left out (the file and stack-frame tables, the kernels' serialized IR,
which embeds source lines): two trees whose digests agree compile the same XLA program, so a
GPU figure measured on one holds for the other as far as the device's work goes, provided
the kernels' code (their IR, left out here) did not change either. ``--source-tree DIR``
compiles the jaxllm checked out at DIR (another commit's ``git worktree``) with this script.

    JAX_PLATFORMS=cpu python -m jaxllm.benchmarks.step_kernels --quantization none,fp8,awq \\
        --buckets 1x1,8x8,64x64,1024x8192 --env JAXLLM_FP8_SWIGLU_KERNEL=off,f32 \\
        --compiler-option xla_gpu_experimental_enable_triton_heroless_priority_fusion=false,true
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import hashlib
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from unittest import mock

from jaxllm.benchmarks.provenance import source_commit, write_json

# The H200's GpuTargetConfigProto (stream_executor/device_description.proto) in text form:
# what XLA's GPU compiler reads of a device (public specifications: 132 SMs, 141 GB HBM3e at
# 4.8 TB/s, 50 MiB of L2, compute capability 9.0a).
H200 = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32
  shared_memory_per_block: 49152 shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  thread_dim_limit_x: 1024 thread_dim_limit_y: 1024 thread_dim_limit_z: 64
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 151397597184
  cuda_compute_capability { major: 9 feature_extension: ACCELERATED_FEATURES }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
  device_vendor: "NVIDIA Corporation" platform_version: "Compute Capability 9.0a"
  device_address_bits: 64 pcie_bandwidth: 34359738368 ecc_enabled: true
  name: "NVIDIA H200" driver_version: "13.0.0" runtime_version: "13.0.0"
  compile_time_toolkit_version: "13.0.0" dnn_version: "9.10.0"
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H200"
"""
H200_MEMORY = int(re.search(r"device_memory_size: (\d+)", H200).group(1))
POOL_BLOCKS = 4096
LAUNCHING = ("fusion", "custom-call", "copy", "while", "conditional", "call", "gather",
             "scatter", "dynamic-update-slice", "sort")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = .*? ("
                          + "|".join(map(re.escape, LAUNCHING)) + r")\(")


def _entry_instructions(hlo_text: str) -> list[str]:
    """The instruction lines of a compiled module's entry computation."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    return entry[:entry.index("\n}")].splitlines()[1:]


def count_kernels(hlo_text: str) -> collections.Counter:
    """Launches of a compiled module's entry computation, by kind: a fusion by its name's stem
    (``loop_add_fusion``, ``gemm_fusion_dot``), a custom call by its target, other ops by
    opcode. ``bitcast``s, tuples, parameters and constants launch nothing."""
    kinds = collections.Counter()
    for line in _entry_instructions(hlo_text):
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        name, op = match.groups()
        if op == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', line)
            kinds["custom-call " + (target.group(1) if target else "?")] += 1
        elif op == "fusion":
            kinds[re.sub(r"(\.\d+)+$", "", name)] += 1
        else:
            kinds[op] += 1
    return kinds


def parameter_readers(hlo_text: str, number: int) -> int:
    """Launching instructions of a compiled module's entry that read entry parameter
    ``number``, directly or through bitcasts and tuples (which alias it): on a GPU, the
    commands of the step's graph that XLA re-records when that buffer's address changed."""
    aliases, readers = set(), 0
    for line in _entry_instructions(hlo_text):
        match = re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+) = .*? ([\w\-]+)\((.*)", line)
        if match is None:
            continue
        name, op, rest = match.groups()
        operands = set(re.findall(r"%([\w.\-]+)", rest.split("), ")[0]))
        if op == "parameter":
            if rest.startswith(f"{number})"):
                aliases.add(name)
        elif op in ("bitcast", "get-tuple-element", "tuple", "opt-barrier"):
            if operands & aliases:
                aliases.add(name)
        elif op in LAUNCHING and operands & aliases:
            readers += 1
    return readers


def graph_structure(paths: list[str]) -> dict:
    """How the executable launches its work, from XLA's thunk sequence (the file its
    ``xla_dump_to`` writes after the thunk passes): ``graphs``, the command buffers (CUDA
    graphs) a step submits; ``graph_commands``, the commands inside them; ``outside_graphs``,
    the thunks launched one by one. Empty when XLA wrote no such file. (With command buffers
    off, ``--xla_gpu_enable_command_buffer=``, XLA runs no thunk passes and writes the
    sequence before them: every thunk is then outside.)"""
    if not paths:
        return {}
    graphs = commands = outside = 0
    with open(paths[0]) as f:
        for line in f:
            match = re.match(r"( *)\d+: (k\w+)", line)
            if match is None:
                continue
            nested, kind = bool(match.group(1)), match.group(2)
            if nested:
                commands += 1
            elif kind == "kCommandBuffer":
                graphs += 1
            else:
                outside += 1
    return {"graphs": graphs, "graph_commands": commands, "outside_graphs": outside}


def program_digest(hlo_text: str) -> str:
    """A digest of a compiled module's text without what only names the source: the tables
    of files and stack frames before the first computation, ops' metadata (their JAX name
    stacks and source lines) and stack-frame ids, the Triton kernels' serialized IR and the
    Mosaic GPU kernels' modules (both embed source paths and lines)."""
    start = min(i for i in (hlo_text.find("\n%"), hlo_text.find("\nENTRY")) if i >= 0)
    text = re.sub(r", (?:metadata=\{[^}]*\}|stack_frame_id=\d+)", "", hlo_text[start:])
    text = re.sub(r'ir = "(?:[^"\\]|\\.)*"', "ir = <kernel>", text)
    text = "\n".join(re.sub(r"backend_config=.*$", "backend_config=<kernel>", line)
                     if 'custom_call_target="mosaic_gpu' in line else line
                     for line in text.splitlines())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def deviceless_gpu(target_config: str = H200):
    """A device of XLA's GPU compiler for ``target_config``: compile for it, never run."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                            topology="1x1x1")
    return topology.devices[0]


@contextlib.contextmanager
def tracing_for_gpu():
    """The engine's GPU choices while tracing in a CPU process: the engine asks
    ``jax.default_backend()`` (Pallas kernels, the Hopper prefill kernel) and Pallas' Triton
    lowering asks the device's compute capability; both are told "an H200"."""
    import jax
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    import jaxllm.attention

    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    with mock.patch.object(jax, "default_backend", lambda: "gpu"), \
            mock.patch.object(jaxllm.attention, "device_compute_capability", lambda: "9.0"), \
            mock.patch.object(pallas_call_registration.gpu_info_lib, "get_gpu_info",
                              lambda: h200):
        yield


def step_program(model: str, quantization: str | None, kv_cache_dtype: str, rows: int,
                 tokens: int, table_width: int, attention_backend: str, device):
    """The engine's forward program for one step shape, lowered for ``device``: (lowered,
    the compile options the engine gives it, the entry parameter numbers of the step's inputs
    that change every step: the packed batch's and the previous step's tokens')."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.attention import HOPPER
    from jaxllm.batch import PackedBatch, pack_batch
    from jaxllm.engine.int4_layout import resolve_int4_layout
    from jaxllm.engine.step_programs import ProgramKey, stage_step_input, step_programs
    from jaxllm.kv_pool import kv_cache_dtype as pool_dtype
    from jaxllm.kv_pool import new_kv_pool
    from jaxllm.layers.linear import int4_hopper_mode
    from jaxllm.loading import load_model
    from jaxllm.quantization.compile_options import forward_compiler_options

    sharding = jax.sharding.SingleDeviceSharding(device)

    def placed(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                            tree)

    described = {}

    def params():  # the loader's dummy params, shapes only
        loaded = load_model(model, load_format="dummy", dtype="bfloat16",
                            quantization=quantization, unroll_layers=True)
        layout, _ = resolve_int4_layout(int4_hopper_mode(), loaded, H200_MEMORY, HOPPER)
        loaded = loaded.with_int4_n_major(layout)  # as the engine would on the H200
        described.update(config=loaded.config, dtype=loaded.dtype,
                         quantization=loaded.quantization)  # (no tracer leaves the trace)
        return loaded.params

    abstract_params = placed(jax.eval_shape(params))
    cfg, dtype = described["config"], described["dtype"]
    # the pool's size changes no kernel, only the memory XLA plans for (a large one makes it
    # rematerialize to fit the device)
    pool = placed(jax.eval_shape(lambda: new_kv_pool(
        cfg, POOL_BLOCKS, 16, pool_dtype(kv_cache_dtype, dtype), unroll_layers=True)))
    batch = pack_batch([], 16, num_tokens=tokens, num_seqs=rows, table_width=table_width,
                       num_logits=rows, decode_only=rows == tokens)
    packed = placed(PackedBatch.pack(batch, np.full(tokens, -1, np.int32)))
    max_rows = max(rows, 1024)
    programs = step_programs(ProgramKey(cfg, dtype, attention_backend, None, max_rows,
                                        stage_step_input()))
    prev_tokens = jax.ShapeDtypeStruct((max_rows,), jnp.int32, sharding=sharding)
    with tracing_for_gpu():
        # traced anew: what the program reads of the environment (JAXLLM_FP8_SWIGLU_KERNEL)
        # is read as it is traced, and JAX would reuse an earlier trace of the same shapes
        jax.clear_caches()
        lowered = programs.forward.lower(abstract_params, pool, packed, prev_tokens)
    first = len(jax.tree.leaves(abstract_params)) + len(jax.tree.leaves(pool))
    # (params, pool, packed, prev_tokens) -> the program's parameter numbers: JAX drops the
    # inputs a program never reads (the N-major copies of JAXLLM_INT4_HOPPER=both at 1-16
    # rows), which renumbers the ones after them
    kept = sorted(lowered._lowering.compile_args["kept_var_idx"])
    inputs = {"batch": kept.index(first), "prev_tokens": kept.index(first + 1)}
    return lowered, forward_compiler_options(described["quantization"]), inputs


def _variants(specs: list[str], typed: bool = False) -> list[dict]:
    """``NAME=a,b`` specs -> every combination of their values (one dict each); ``typed``:
    "true" / "false" and integers as XLA's options take them."""
    def value(text: str):
        if typed and text in ("true", "false"):
            return text == "true"
        return int(text) if typed and text.lstrip("-").isdigit() else text

    axes = []
    for spec in specs:
        name, _, values = spec.partition("=")
        axes.append([(name, value(v)) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)] or [{}]


def run(args) -> dict:
    from jax._src import config as jax_config

    device = deviceless_gpu()
    rows_out = []
    print(f"{'quantization':<13}{'bucket':>11}  {'setting':<34}{'kernels':>8}{'temp GiB':>9}"
          "  digest            graphs (commands) outside  readers  top kinds",
          flush=True)
    for quantization, bucket, env, xla in itertools.product(
            args.quantization.split(","), args.buckets.split(","), _variants(args.env),
            _variants(args.compiler_option, typed=True)):
        rows, tokens = (int(n) for n in bucket.split("x"))
        with mock.patch.dict(os.environ, env):
            t0 = time.perf_counter()
            lowered, options, inputs = step_program(
                args.model, None if quantization == "none" else quantization,
                args.kv_cache_dtype, rows, tokens, args.table_width, args.attention_backend,
                device)
            # XLA's thunks (the GPU's launches) are written only by a compile, never on a
            # hit in JAX's persistent cache (whose key leaves the dump options out)
            with tempfile.TemporaryDirectory() as dump, \
                    jax_config.enable_compilation_cache(False):
                compiled = lowered.compile(compiler_options=options | xla | {
                    "xla_dump_to": dump, "xla_dump_hlo_module_re": "forward"})
                graphs = graph_structure(
                    glob.glob(os.path.join(dump, "*thunk_sequence_after_thunk_passes.txt"))
                    or glob.glob(os.path.join(dump, "*thunk_sequence.txt")))
        hlo = compiled.as_text()  # the optimized program (a large text: printed once)
        kinds = count_kernels(hlo)
        if args.hlo_dir:  # to read what a fusion computes
            os.makedirs(args.hlo_dir, exist_ok=True)
            stem = "_".join([quantization, bucket, *(f"{k}={v}" for k, v in (env | xla).items())])
            with open(os.path.join(args.hlo_dir, f"{stem}.hlo.txt"), "w") as f:
                f.write(hlo)
        # what a new address of each step input makes XLA re-record in the step's graph
        readers = {name: parameter_readers(hlo, number) for name, number in inputs.items()}
        # what the KV planner subtracts (jaxllm.engine.kv_sizing.activation_bytes)
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
        row = {"quantization": quantization, "rows": rows, "tokens": tokens, "env": env,
               "compiler_options": xla, "kernels": sum(kinds.values()),
               "by_kind": dict(kinds.most_common()), "temp_bytes": temp,
               "program_digest": program_digest(hlo), **graphs,
               "input_readers": readers,
               "compile_s": time.perf_counter() - t0}
        rows_out.append(row)
        top = ", ".join(f"{kind} {n}" for kind, n in kinds.most_common(3))
        setting = " ".join(f"{k}={v}" for k, v in (env | xla).items())
        print(f"{quantization:<13}{bucket:>11}  {setting:<34}{row['kernels']:>8}"
              f"{temp / 2**30:>9.2f}  {row['program_digest']}  "
              f"{row.get('graphs', '-'):>6} ({row.get('graph_commands', '-'):>6}) "
              f"{row.get('outside_graphs', '-'):>7} {readers['batch']:>8}  {top}", flush=True)
    return {"benchmark": "step_kernels", "commit": source_commit(), "target": "H200",
            "args": vars(args), "rows": rows_out}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b", help="a preset (dummy weights)")
    parser.add_argument("--quantization", default="none",
                        help="comma-separated: none, fp8, int8, awq, gptq")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--buckets", default="1x1,8x8,64x64,256x256,1024x8192",
                        help="comma-separated ROWSxTOKENS step shapes (ROWS == TOKENS: decode)")
    parser.add_argument("--table-width", type=int, default=64, help="blocks a sequence holds")
    parser.add_argument("--attention-backend", default="pallas_mosaic",
                        help="the engine's on the H200: pallas_mosaic")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=V1,V2",
                        help="an environment variable's values to compile under (repeatable)")
    parser.add_argument("--compiler-option", action="append", default=[],
                        metavar="NAME=V1,V2",
                        help="an XLA option's values to compile with (repeatable), e.g. "
                             "xla_gpu_enable_command_buffer=")
    parser.add_argument("--source-tree", default=None, metavar="DIR",
                        help="compile the jaxllm of this checkout (e.g. an older commit's "
                             "worktree) instead of this one's")
    parser.add_argument("--hlo-dir", default=None, help="write each compiled program's "
                        "optimized HLO there")
    parser.add_argument("--output-json", default=None)
    return parser.parse_args(argv)


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` without ``options`` and their values (``--opt v`` or ``--opt=v``)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not arg.startswith(tuple(o + "=" for o in options)):
            kept.append(arg)
    return kept


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.source_tree:  # this file run over the other tree's jaxllm, in that tree
        tree = os.path.abspath(args.source_tree)
        rest = _without(argv, ("--source-tree", "--output-json"))
        if args.output_json:
            rest += ["--output-json", os.path.abspath(args.output_json)]
        sys.exit(subprocess.run([sys.executable, os.path.abspath(__file__), *rest], cwd=tree,
                                env=os.environ | {"PYTHONPATH": tree}).returncode)
    write_json(run(args), args.output_json)


if __name__ == "__main__":
    main()
