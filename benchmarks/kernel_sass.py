"""``python -m jaxllm.benchmarks.kernel_sass``: instruction counts of an attention kernel's
loops as compiled for the H200 (sm_90), on a machine without a GPU.

Not a timing: a way to see what a kernel change does to the code a GPU would run, between
device calls. The kernel's Triton IR is captured from JAX's own lowering (the GPU query faked
to compute capability 9.0), compiled to a cubin by ``triton.compile`` in an interpreter that
has the ``triton`` package (``--triton-python``; Triton 3.6 from PyPI, which may differ from
the Triton inside jaxlib), disassembled with the ``cuobjdump`` shipped with that package, and
every loop holding MMA instructions (``HMMA``/``HGMMA``) is printed with its instruction count
per warp and iteration and its most frequent opcodes.

    python -m jaxllm.benchmarks.kernel_sass --kernel decode --kv-dtype float8_e4m3fn \\
        --triton-python /tmp/tvenv/bin/python --output-json sass.json
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
import types

# Llama-3-8B's attention: 32 query heads over 8 kv heads of 128, pages of 16.
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16

_COMPILE = """
import os, sys, triton
from triton.backends.compiler import GPUTarget
ttir, warps, stages, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
kernel = triton.compile(ttir, target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": warps, "num_stages": stages})
open(out, "wb").write(kernel.asm["cubin"])
print(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
"""


def capture_ttir(kernel: str, kv_dtype: str, tokens: int, context: int) -> tuple[str, int, int]:
    """The kernel's Triton IR (text) as JAX lowers it for an sm_90 GPU, and its warps and
    stages."""
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import pallas_call_registration as registration
    from jaxllm.pallas_kernels.paged_attention import (
        paged_attention_decode,
        paged_attention_prefill,
    )
    from jaxllm.pallas_kernels.paged_attention.decode import DecodeConfig
    from jaxllm.pallas_kernels.paged_attention.prefill import PrefillConfig

    captured = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def keep(*args, **kwargs):
        module = lower(*args, **kwargs)
        captured.append(module.module.operation.get_asm(enable_debug_info=False))
        return module

    seqs = tokens if kernel == "decode" else 1
    width = -(-(context + tokens) // BLOCK)
    kv = jnp.dtype(kv_dtype)
    pool = jax.ShapeDtypeStruct((1, seqs * width + 1, BLOCK, KV_HEADS, HEAD_DIM), kv)
    args = (jax.ShapeDtypeStruct((tokens, HEADS, HEAD_DIM), jnp.bfloat16), pool, pool,
            jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((seqs, width), jnp.int32),
            jax.ShapeDtypeStruct((seqs,), jnp.int32), jax.ShapeDtypeStruct((seqs + 1,), jnp.int32),
            jax.ShapeDtypeStruct((tokens,), jnp.int32))
    run = paged_attention_decode if kernel == "decode" else paged_attention_prefill
    config = DecodeConfig() if kernel == "decode" else PrefillConfig()
    saved = (registration.lowering.lower_jaxpr_to_triton_module,
             registration.gpu_info_lib.get_gpu_info)
    registration.lowering.lower_jaxpr_to_triton_module = keep
    registration.gpu_info_lib.get_gpu_info = lambda: types.SimpleNamespace(compute_capability=90)
    try:
        jax.jit(lambda *a: run(*a, scale=HEAD_DIM**-0.5)).trace(*args).lower(
            lowering_platforms=("cuda",))
    finally:
        (registration.lowering.lower_jaxpr_to_triton_module,
         registration.gpu_info_lib.get_gpu_info) = saved
    return captured[-1], config.num_warps, config.num_stages


def mma_loops(sass: str) -> list[dict]:
    """Every loop (a backward branch's span) holding MMA instructions: its instruction count
    and opcode histogram."""
    code = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)(.*)", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2), m.group(3)))
    where = {address: i for i, (address, _, _) in enumerate(code)}
    loops = []
    for i, (address, op, rest) in enumerate(code):
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in where:
            body = [op for _, op, _ in code[where[int(target.group(1), 16)]:i + 1]]
            if any(op.startswith(("HMMA", "HGMMA")) for op in body):
                loops.append({"start": hex(code[where[int(target.group(1), 16)]][0]),
                              "instructions": len(body),
                              "opcodes": dict(collections.Counter(body).most_common(16))})
    return loops


def run(args) -> dict:
    from jaxllm.benchmarks.provenance import source_commit, write_json

    ttir, warps, stages = capture_ttir(args.kernel, args.kv_dtype, args.tokens, args.context)
    with tempfile.TemporaryDirectory() as tmp:
        ttir_path, cubin = os.path.join(tmp, "kernel.ttir"), os.path.join(tmp, "kernel.cubin")
        with open(ttir_path, "w") as f:
            f.write(ttir)
        done = subprocess.run([args.triton_python, "-c", _COMPILE, ttir_path, str(warps),
                               str(stages), cubin], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"triton.compile failed in {args.triton_python}:\n{done.stderr}")
        cuobjdump = done.stdout.strip().splitlines()[-1]
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    result = {"commit": source_commit(), "kernel": args.kernel, "kv_dtype": args.kv_dtype,
              "tokens": args.tokens, "context": args.context,
              "num_warps": warps, "num_stages": stages,
              "loops": mma_loops(sass)}
    print(f"{args.kernel} over {args.kv_dtype} pages ({warps} warps, {stages} stages):")
    for loop in result["loops"]:
        top = ", ".join(f"{op} {n}" for op, n in list(loop["opcodes"].items())[:8])
        print(f"  loop at {loop['start']}: {loop['instructions']} instructions; {top}")
    write_json(result, args.output_json)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=["decode", "prefill"], default="decode")
    parser.add_argument("--kv-dtype", choices=["bfloat16", "float8_e4m3fn"], default="bfloat16")
    parser.add_argument("--tokens", type=int, default=None,
                        help="decode: sequences (256); prefill: chunk tokens (2048)")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens before them")
    parser.add_argument("--triton-python", required=True,
                        help="an interpreter with the triton package (e.g. a venv with "
                        "triton==3.6.0: its compiler and cuobjdump need no GPU)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if args.tokens is None:
        args.tokens = 256 if args.kernel == "decode" else 2048
    run(args)


if __name__ == "__main__":
    main()
