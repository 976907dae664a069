"""``python -m jaxllm.benchmarks.kernel_sass``: instruction counts of an attention kernel's
loops, or of the int4 GEMV's, as compiled for the H200 (sm_90), on a machine without a GPU.

Not a timing: a way to see what a kernel change does to the code a GPU would run, between
device calls. The kernel's Triton IR is captured from JAX's own lowering (the GPU query faked
to compute capability 9.0), compiled to a cubin by ``triton.compile`` in an interpreter that
has the ``triton`` package (``--triton-python``; Triton 3.6 from PyPI), disassembled with the
``cuobjdump`` shipped with that package, and every loop holding MMA instructions
(``HMMA``/``HGMMA``) is printed with its instruction count per warp and iteration and its most
frequent opcodes. ``--compiler xla`` compiles the kernel as the engine does instead, by XLA's
GPU compiler for an H200 with the Triton inside jaxlib, and reads its cubin out of the
executable (xla_cubin.py); this process then needs jax's CUDA plugin (JAX_PLATFORMS=cpu). The
two differ: ``triton.compile`` contracts a multiply and an add into an FMA, XLA does not.

``--kernel matmul`` (the tiled int4 kernel, --matmul-config's fields) is printed as the
attention kernels are. ``--kernel rmsnorm_fp8`` / ``swiglu_fp8`` (the FP8 activation kernels
at --tokens rows of --hidden / --intermediate) print their registers, stack (spills) and
instruction count (``cuobjdump -res-usage``). ``--kernel gemv`` (the int4 GEMV over a [--k,
--n] weight at --tokens, group --group-size, with the config gemv_config picks or
--gemv-config's fields) has no MMA: its main loop is its longest backward branch (or, when each
program runs one step and the loop is gone, the whole kernel), printed with instructions per
thread and iteration, per weight, and every opcode, its registers and the 16-byte loads it
issues before its first FMA; ``--kernel gemv_nk`` the same for the GEMV over the N-major
weight (gemv_nk.py).

    python -m jaxllm.benchmarks.kernel_sass --kernel decode --kv-dtype float8_e4m3fn \\
        --triton-python /tmp/tvenv/bin/python --output-json sass.json
    python -m jaxllm.benchmarks.kernel_sass --kernel gemv --k 14336 --n 4096 \\
        --gemv-config block_words=8,denormal=False --triton-python /tmp/tvenv/bin/python
    JAX_PLATFORMS=cpu /tmp/cudavenv/bin/python -m jaxllm.benchmarks.kernel_sass --kernel gemv \
        --n 6144 --compiler xla --triton-python /tmp/cudavenv/bin/python
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from unittest import mock

ACTIVATION_KERNELS = ("rmsnorm_fp8", "swiglu_fp8")  # pallas_kernels/activation_quant
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


def kernel_ttir(fn, args) -> str:
    """The Triton IR (text) of the last Pallas kernel in ``jax.jit(fn)`` as JAX lowers it for
    an sm_90 GPU (the GPU query faked: ``step_kernels.tracing_for_gpu``)."""
    import jax
    from jax._src.pallas.triton import pallas_call_registration as registration
    from jaxllm.benchmarks.step_kernels import tracing_for_gpu

    captured = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def keep(*a, **kw):
        module = lower(*a, **kw)
        captured.append(module.module.operation.get_asm(enable_debug_info=False))
        return module

    with tracing_for_gpu(), mock.patch.object(registration.lowering,
                                              "lower_jaxpr_to_triton_module", keep):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return captured[-1]


def capture_attention(kernel: str, kv_dtype: str, tokens: int, context: int) -> tuple:
    """An attention kernel's program ``(fn, args)``, and its warps and stages."""
    import jax
    import jax.numpy as jnp
    from jaxllm.pallas_kernels.paged_attention import (
        paged_attention_decode,
        paged_attention_prefill,
    )
    from jaxllm.pallas_kernels.paged_attention.decode import DecodeConfig
    from jaxllm.pallas_kernels.paged_attention.prefill import PrefillConfig

    seqs = tokens if kernel == "decode" else 1
    width = -(-(context + tokens) // BLOCK)
    kv = jnp.dtype(kv_dtype)
    pool = jax.ShapeDtypeStruct((1, seqs * width + 1, BLOCK, KV_HEADS, HEAD_DIM), kv)
    args = (jax.ShapeDtypeStruct((tokens, HEADS, HEAD_DIM), jnp.bfloat16), pool, pool,
            jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((seqs, width), jnp.int32),
            jax.ShapeDtypeStruct((seqs,), jnp.int32), jax.ShapeDtypeStruct((seqs + 1,), jnp.int32),
            jax.ShapeDtypeStruct((tokens,), jnp.int32))
    run = paged_attention_decode if kernel == "decode" else paged_attention_prefill
    config = DecodeConfig() if kernel == "decode" else PrefillConfig.for_dtypes(jnp.bfloat16, kv)
    return (lambda *a: run(*a, scale=HEAD_DIM**-0.5), args), config.num_warps, config.num_stages


def capture_int4(kernel: str, k: int, n: int, tokens: int, group: int,
                 config) -> tuple:
    """An int4 kernel's program ``(fn, args)`` ("gemv" or "matmul", the tiled one) over a
    [K, N] weight at ``tokens`` bf16 rows, and its warps and stages."""
    import jax
    import jax.numpy as jnp
    from jaxllm.pallas_kernels.quantized_matmul import int4_gemv, int4_gemv_nk, int4_matmul

    spec = jax.ShapeDtypeStruct
    if kernel == "gemv_nk":  # the N-major weight, its zero points centred (as the engine's)
        args = [spec((tokens, k), jnp.bfloat16), spec((n, k), jnp.int4),
                spec((k // group, n), jnp.bfloat16), spec((k // group, n), jnp.bfloat16)]
        return (lambda x, w, s, z: int4_gemv_nk(x, w, s, z, group_size=group, config=config,
                                                centred_zeros=True), args), config.num_warps, 1
    run = {"gemv": int4_gemv, "matmul": int4_matmul}[kernel]
    args = [spec((tokens, k), jnp.bfloat16), spec((k // 8, n), jnp.int32),
            spec((k // group, n), jnp.bfloat16), spec((k // group, n), jnp.uint8)]
    program = (lambda x, q, s, z: run(x, q, s, z, group_size=group, config=config), args)
    return program, config.num_warps, config.num_stages


def capture_activation_quant(kernel: str, tokens: int, hidden: int,
                             intermediate: int) -> tuple:
    """An FP8 activation kernel's program ``(fn, args)`` ("rmsnorm_fp8" over bf16 rows of
    ``hidden``, "swiglu_fp8" over gate_up's bf16 product of ``intermediate`` pairs) at
    ``tokens`` rows, and its warps and stages."""
    import jax
    import jax.numpy as jnp
    from jaxllm.pallas_kernels.activation_quant import (
        rmsnorm_quantize_fp8,
        rows_fp8,
        swiglu_fp8,
        swiglu_quantize_fp8,
    )

    spec = jax.ShapeDtypeStruct
    if kernel == "rmsnorm_fp8":
        return ((lambda x, w: rmsnorm_quantize_fp8(x, w, 1e-5),
                 [spec((tokens, hidden), jnp.bfloat16), spec((hidden,), jnp.bfloat16)]),
                rows_fp8.NUM_WARPS, 1)
    return ((lambda p, xs, ws: swiglu_quantize_fp8(p, xs, ws, jnp.bfloat16),
             [spec((tokens, 2 * intermediate), jnp.bfloat16), spec((tokens, 1), jnp.float32),
              spec((2 * intermediate,), jnp.float32)]), swiglu_fp8.num_warps(intermediate), 1)


def _code(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every instruction (predicates dropped)."""
    code = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)(.*)", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return code


def _opcodes(sass: str) -> list[str]:
    return [op for _, op, _ in _code(sass)]


def loops(sass: str, mma_only: bool = True) -> list[dict]:
    """Every loop (a backward branch's span; with ``mma_only``, those holding MMA instructions:
    ``HMMA``/``HGMMA``): its start, instruction count and opcode histogram."""
    code = _code(sass)
    where = {address: i for i, (address, _, _) in enumerate(code)}
    found = []
    for i, (address, op, rest) in enumerate(code):
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in where:
            body = [op for _, op, _ in code[where[int(target.group(1), 16)]:i + 1]]
            if not mma_only or any(op.startswith(("HMMA", "HGMMA")) for op in body):
                found.append({"start": hex(code[where[int(target.group(1), 16)]][0]),
                              "instructions": len(body),
                              "opcodes": dict(collections.Counter(body).most_common())})
    return found


def compile_sass(program, warps: int, stages: int, triton_python: str,
                 usage: dict | None = None, compiler: str = "triton") -> str:
    """The SASS of ``program``'s Pallas kernel for sm_90: compiled from its Triton IR by
    ``triton_python``'s Triton (``compiler`` "triton"), or by XLA as the engine compiles it
    ("xla": this process needs jax's CUDA plugin; xla_cubin.py); with ``usage``, the kernel's
    registers, stack and shared memory (``cuobjdump -res-usage``) are put in it."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        if compiler == "xla":
            cuobjdump = _xla_cubin(program, cubin, triton_python)
        else:
            ttir_path = os.path.join(tmp, "kernel.ttir")
            with open(ttir_path, "w") as f:
                f.write(kernel_ttir(*program))
            done = subprocess.run([triton_python, "-c", _COMPILE, ttir_path, str(warps),
                                   str(stages), cubin], capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"triton.compile failed in {triton_python}:\n{done.stderr}")
            cuobjdump = done.stdout.strip().splitlines()[-1]
        if usage is not None:
            text = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True,
                                  text=True, check=True).stdout
            usage.update({key.lower(): int(value) for key, value
                          in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)})
        return subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout


def _xla_cubin(program, cubin: str, triton_python: str) -> str:
    """Writes the cubin of the Pallas kernel in XLA's executable of ``program`` (the one
    whose function is no XLA fusion) to ``cubin``; returns the cuobjdump to read it with."""
    from jaxllm.benchmarks.xla_cubin import compile_deviceless, executable_cubins

    cuobjdump = subprocess.run(
        [triton_python, "-c", "import os, triton; print(os.path.join(os.path.dirname("
         "triton.__file__), 'backends', 'nvidia', 'bin', 'cuobjdump'))"],
        capture_output=True, text=True, check=True).stdout.strip()
    for image in executable_cubins(compile_deviceless(*program)):
        with open(cubin, "wb") as f:
            f.write(image)
        names = re.findall(r"Function (\S+):", subprocess.run(
            [cuobjdump, "-res-usage", cubin], capture_output=True, text=True).stdout)
        if names and not any("fusion" in n or n.startswith("wrapped_") for n in names):
            return cuobjdump
    raise SystemExit("no Pallas kernel among the executable's cubins")


def config_fields(text: str | None) -> dict:
    """'a=1,b=False,c=last' as config fields (ints, booleans, None, else strings)."""
    fields = {}
    for item in filter(None, (text or "").split(",")):
        name, value = (part.strip() for part in item.split("="))
        constants = {"True": True, "False": False, "None": None}
        if value in constants:
            fields[name] = constants[value]
        else:
            try:
                fields[name] = int(value)
            except ValueError:
                fields[name] = value
    return fields


def _gemv_config(args):
    """The config named by --gemv-config (fields over the defaults), else the kernel's pick
    (gemv_config's, or for gemv_nk nk_gemv_config's)."""
    from jaxllm.pallas_kernels.quantized_matmul import (
        Int4GemvConfig,
        Int4GemvNKConfig,
        gemv_config,
    )
    from jaxllm.pallas_kernels.quantized_matmul.gemv_nk import nk_gemv_config

    if args.kernel == "gemv_nk":
        if args.gemv_config is None:
            return nk_gemv_config(args.tokens)
        return Int4GemvNKConfig(**config_fields(args.gemv_config))
    if args.gemv_config is None:
        return gemv_config(args.tokens, args.k, args.n, args.group_size)
    return Int4GemvConfig(**config_fields(args.gemv_config))


def first_load_burst(sass: str) -> int:
    """16-byte global loads issued before the first FMA (or multiply: XLA's compile keeps
    multiply and add apart): how many of a step's weight loads a thread has in flight at once
    (ptxas may sink each just ahead of its products)."""
    burst = 0
    for op in _opcodes(sass):
        if op.startswith("LDG.E.128"):
            burst += 1
        elif op.startswith(("FFMA", "FMUL")) and burst:
            break
    return burst


def run_gemv(args) -> dict:
    """The GEMV's main loop (its longest loop): instructions per iteration and per weight."""
    from jaxllm.benchmarks.provenance import source_commit, write_json
    from jaxllm.pallas_kernels.quantized_matmul.gemv_nk import step_words_of
    from jaxllm.pallas_kernels.quantized_matmul.reference import PER_WORD

    config = _gemv_config(args)
    program, warps, stages = capture_int4(args.kernel, args.k, args.n, args.tokens,
                                          args.group_size, config)
    usage = {}
    sass = compile_sass(program, warps, stages, args.triton_python, usage, args.compiler)
    if args.sass_out:
        with open(args.sass_out, "w") as f:
            f.write(sass)
    found = loops(sass, mma_only=False)
    if args.kernel == "gemv_nk":
        step = step_words_of(args.group_size)
        splits = config.splits(args.k, args.n, step)
    else:
        step = config.step_words(args.k, args.group_size)
        splits = config.splits(args.k, args.n, args.group_size)
    steps = args.k // PER_WORD // step // splits
    if found:
        main_loop = max(found, key=lambda loop: loop["instructions"])
        iterations = getattr(config, "unroll_steps", 1)  # steps an iteration
    else:  # one step a program: the loop is gone; count the whole kernel (its set-up too)
        body = [op for op in _opcodes(sass) if op not in ("NOP", "EXIT", "BRA")]
        main_loop = {"start": "kernel (no loop)", "instructions": len(body),
                     "opcodes": dict(collections.Counter(body).most_common())}
        iterations = steps
    # One step reads step_words x 8 weights of block_n columns with 32 x num_warps threads;
    # a SASS instruction is one per thread.
    weights = iterations * step * PER_WORD * config.block_n
    per_thread = weights / (32 * warps)
    result = {"commit": source_commit(), "kernel": args.kernel, "k": args.k, "n": args.n,
              "tokens": args.tokens, "group_size": args.group_size, "config": repr(config),
              "steps_per_program": steps,
              "num_warps": warps, "num_stages": stages, "resources": usage,
              "first_load_burst": first_load_burst(sass), "programs":
              -(-args.n // config.block_n) * splits,
              "weights_per_iteration": weights,
              "weights_per_thread": per_thread, "loops": found,
              "main_loop": main_loop,
              "instructions_per_weight": main_loop["instructions"] / per_thread}
    print(f"{args.kernel} K={args.k} N={args.n} tokens={args.tokens} group={args.group_size}: "
          f"{config}")
    print(f"  resources: {usage}; {result['programs']} programs; 16-byte loads before the "
          f"first FMA: {result['first_load_burst']}")
    print(f"  main loop at {main_loop['start']}: {main_loop['instructions']} instructions an "
          f"iteration per thread ({steps} steps a program), {per_thread:g} weights per thread -> "
          f"{result['instructions_per_weight']:.2f} instructions per weight")
    print("  " + ", ".join(f"{op} {n}" for op, n in main_loop["opcodes"].items()))
    for loop in found:
        if loop is not main_loop:
            print(f"  (other loop at {loop['start']}: {loop['instructions']} instructions)")
    write_json(result, args.output_json)
    return result


def run_activation_quant(args) -> dict:
    """An FP8 activation kernel's registers, spills and instruction count (it has no MMA
    loop: the whole kernel, its loops listed)."""
    from jaxllm.benchmarks.provenance import source_commit, write_json

    program, warps, stages = capture_activation_quant(args.kernel, args.tokens, args.hidden,
                                                      args.intermediate)
    usage = {}
    sass = compile_sass(program, warps, stages, args.triton_python, usage, args.compiler)
    body = [op for op in _opcodes(sass) if op not in ("NOP", "EXIT")]
    opcodes = dict(collections.Counter(op.split(".")[0] for op in body).most_common())
    result = {"commit": source_commit(), "kernel": args.kernel, "tokens": args.tokens,
              "hidden": args.hidden, "intermediate": args.intermediate, "num_warps": warps,
              "resources": usage, "instructions": len(body), "opcodes": opcodes,
              "loops": loops(sass, mma_only=False)}
    print(f"{args.kernel} ({warps} warps): {usage}, {len(body)} instructions, "
          f"{len(result['loops'])} loops")
    print("  " + ", ".join(f"{op} {n}" for op, n in list(opcodes.items())[:16]))
    if args.sass_out:
        with open(args.sass_out, "w") as f:
            f.write(sass)
    write_json(result, args.output_json)
    return result


def run(args) -> dict:
    from jaxllm.benchmarks.provenance import source_commit, write_json

    if args.kernel in ("gemv", "gemv_nk"):
        return run_gemv(args)
    if args.kernel in ACTIVATION_KERNELS:
        return run_activation_quant(args)
    if args.kernel == "matmul":
        from jaxllm.pallas_kernels.quantized_matmul import Int4MatmulConfig

        config = Int4MatmulConfig(**config_fields(args.matmul_config))
        program, warps, stages = capture_int4("matmul", args.k, args.n, args.tokens,
                                           args.group_size, config)
    else:
        program, warps, stages = capture_attention(args.kernel, args.kv_dtype, args.tokens,
                                           args.context)
    sass = compile_sass(program, warps, stages, args.triton_python, compiler=args.compiler)
    result = {"commit": source_commit(), "kernel": args.kernel, "kv_dtype": args.kv_dtype,
              "tokens": args.tokens, "context": args.context,
              "num_warps": warps, "num_stages": stages,
              "loops": loops(sass)}
    if args.kernel == "matmul":
        result.update(k=args.k, n=args.n, group_size=args.group_size, config=repr(config))
        print(f"matmul K={args.k} N={args.n} tokens={args.tokens}: {config}")
    else:
        print(f"{args.kernel} over {args.kv_dtype} pages ({warps} warps, {stages} stages):")
    for loop in result["loops"]:
        top = ", ".join(f"{op} {n}" for op, n in list(loop["opcodes"].items())[:8])
        print(f"  loop at {loop['start']}: {loop['instructions']} instructions; {top}")
    write_json(result, args.output_json)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="decode",
                        choices=["decode", "prefill", "gemv", "gemv_nk", "matmul",
                                 *ACTIVATION_KERNELS])
    parser.add_argument("--kv-dtype", choices=["bfloat16", "float8_e4m3fn"], default="bfloat16")
    parser.add_argument("--tokens", type=int, default=None,
                        help="decode: sequences (256); prefill: chunk tokens (2048); gemv: 1")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens before them")
    parser.add_argument("--k", type=int, default=4096, help="gemv: the weight's K")
    parser.add_argument("--n", type=int, default=4096, help="gemv: the weight's N")
    parser.add_argument("--group-size", type=int, default=128, help="gemv: the int4 group")
    parser.add_argument("--hidden", type=int, default=4096, help="rmsnorm_fp8: the row")
    parser.add_argument("--intermediate", type=int, default=14336,
                        help="swiglu_fp8: the MLP's width (gate, up pairs)")
    parser.add_argument("--gemv-config", default=None,
                        help="gemv: Int4GemvConfig fields, e.g. 'block_n=256,num_warps=8' "
                        "(default: gemv_config's pick, GEMV_TABLE's entry where listed); "
                        "gemv_nk: Int4GemvNKConfig fields (default: nk_gemv_config's)")
    parser.add_argument("--matmul-config", default=None,
                        help="matmul (the tiled int4 kernel): Int4MatmulConfig fields, e.g. "
                        "'one_dot=True' (default: the defaults)")
    parser.add_argument("--sass-out", default=None,
                        help="gemv and the activation kernels: write the whole SASS here")
    parser.add_argument("--triton-python", required=True,
                        help="an interpreter with the triton package (e.g. a venv with "
                        "triton==3.6.0: its compiler and cuobjdump need no GPU)")
    parser.add_argument("--compiler", choices=["triton", "xla"], default="triton",
                        help="triton: triton.compile of the kernel's Triton IR (FP "
                        "contraction on); xla: XLA's compile, as the engine runs it (run this "
                        "under a Python with jax's CUDA plugin, JAX_PLATFORMS=cpu)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if args.tokens is None:
        args.tokens = {"decode": 256, "prefill": 2048, "gemv": 1, "gemv_nk": 1, "matmul": 128,
                       "rmsnorm_fp8": 64, "swiglu_fp8": 64}[args.kernel]
    return run(args)


if __name__ == "__main__":
    main()
