"""The benchmark tools besides ``bench throughput / serve`` (test_bench_commands.py), on CPU
at tiny sizes: the results' provenance, the mixed-step, generate-step, latency, step-profile
and prefill-anatomy benchmarks, the checkpoint writer and the SASS reader."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess

import pytest
from conftest import TINY_HF_CONFIG, tiny_bench_args
from deviceless import needs_cuda_plugin
from jaxllm.benchmarks.__main__ import main as bench_main

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_results_name_the_source_they_ran(monkeypatch):
    from jaxllm.benchmarks.provenance import source_commit

    monkeypatch.delenv("JAXLLM_COMMIT", raising=False)
    described = source_commit()  # a git checkout: a commit id, "-dirty" if the tree differs
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT).stdout.strip()
    assert head in described
    monkeypatch.setenv("JAXLLM_COMMIT", "abc1234")  # a copied tree whose .git lags behind
    assert source_commit() == "abc1234"


def test_mixed_step_benchmark_smoke(tmp_path):
    """benchmarks/mixed_step.py end to end in the Pallas interpreter at tiny sizes."""
    from jaxllm.benchmarks.mixed_step import main as mixed_step_main

    out = tmp_path / "mixed.json"
    assert mixed_step_main(["--smoke", "--heads", "small_gqa", "--decodes", "5",
                            "--max-context", "60", "--chunks", "20@0,4@30",
                            "--padded-tokens", "40", "--layers", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["real_tokens"] == 29 and r["max_abs_diff_mixed_vs_prefill"] < 1e-2
    assert set(r["step_ms"]) == {"prefill_kernel", "mixed"} and r["mixed_speedup"] > 0


@pytest.mark.parametrize("layers", ["--no-unroll-layers", "--unroll-layers"])
def test_generate_step_benchmark_smoke(tiny_config, tmp_path, layers):
    """benchmarks/generate_step.py end to end on the tiny model: one row per capacity, the
    contiguous cache sized from the capacity, and a capacity too small for the run refused."""
    from jaxllm.benchmarks.generate_step import main as generate_step_main

    out = tmp_path / "gen.json"
    assert generate_step_main(["--model", tiny_config, "--dtype", "float32", "--batch-size", "2",
                               "--prompt-len", "8", "--capacities", "16,64", "--short", "2",
                               "--decode-steps", "4", layers, "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [row["capacity"] for row in r["rows"]] == [16, 64]
    assert r["unrolled"] == (layers == "--unroll-layers")
    # 2 rows x ceil((8 + C) / 16) blocks of 16 tokens, 2 layers x K and V x 2 heads x 16 x 4 B
    assert [row["contiguous_cache_bytes"] for row in r["rows"]] == [
        2 * n * 16 * 2 * 2 * 2 * 16 * 4 for n in (2, 5)]
    # Timings at this size are noise (a difference of two runs can go negative): only present.
    assert all(math.isfinite(row["decode_ms"] + row["prefill_ms"]) for row in r["rows"])
    with pytest.raises(SystemExit):
        generate_step_main(["--model", tiny_config, "--capacities", "4", "--short", "2",
                            "--decode-steps", "4"])


def test_step_profile_reads_the_shape_of_the_launched_step():
    """``bench step_profile`` records each traced step's shape from the engine's launched
    step, whether its sampler is launched or (constrained rows) still waits for a bitmask."""
    import types

    from jaxllm.benchmarks.step_profile import _step_info

    from jaxllm.engine.buckets import StepShape
    from jaxllm.engine.llm_engine import _LaunchedStep
    from jaxllm.engine.step_handles import LaunchedForward, PendingStep

    out = types.SimpleNamespace(num_batched_tokens=37)
    shape = StepShape(num_tokens=64, num_seqs=8, table_width=4, is_decode=False)
    full = _LaunchedStep(out, [], [], pending=PendingStep(None, None, shape))
    waiting = _LaunchedStep(out, [], [0], forward=LaunchedForward(None, shape))
    expected = {"real_tokens": 37, "bucket_tokens": 64, "rows": 8, "decode": False}
    for step in (full, waiting):
        assert _step_info(types.SimpleNamespace(_inflight=step)) == expected
    assert _step_info(types.SimpleNamespace(_inflight=None)) is None


def test_step_profile_sequence_gives_each_position_of_a_step_apart():
    """``--sequence``: the matching kernels in launch order, one median a position over the
    traced steps (a layer's projections told apart), and a clear error when the count does not
    split into the steps."""
    from jaxllm.benchmarks.step_profile import step_sequence

    kernels, t = [], 0
    for step in range(3):
        for name, us in (("int4_gemv_1", 10), ("fusion_2", 99), ("int4_gemv_3", 40 + step)):
            kernels.append((name, t, us * 1000))
            t += 100_000
    kernels.reverse()  # launch order comes from the start times, not the list's order
    seq = step_sequence(kernels, 3, "gemv")
    assert seq == {"pattern": "gemv", "per_step": 2, "names": ["int4_gemv", "int4_gemv"],
                   "median_us": [10.0, 41.0]}
    assert "error" in step_sequence(kernels, 4, "gemv")
    # two layers of (GEMV, attention, GEMV) and the LM head after them, over 2 steps: each
    # position of a layer, its median over the layers and its ms a step
    kernels, t = [], 0
    for _ in range(2):
        for layer in range(2):
            for name, us in (("int4_gemv", 10 + layer), ("paged_attention_decode", 7),
                             (f"int4_gemv_{layer + 1}", 30 + 2 * layer)):
                kernels.append((name, t, us * 1000))
                t += 100_000
        kernels.append(("gemm_fusion_dot", t, 300_000))
        t += 100_000
    seq = step_sequence(kernels, 2, "gemv|attention|gemm", layers=2)
    assert seq["by_layer"] == [
        {"name": "int4_gemv", "median_us": 10.5, "ms_a_step": 0.021},
        {"name": "paged_attention_decode", "median_us": 7.0, "ms_a_step": 0.014},
        {"name": "int4_gemv", "median_us": 31.0, "ms_a_step": 0.062}]
    assert seq["outside_layers"] == [{"name": "gemm_fusion_dot", "median_us": 300.0}]
    # no repeating layer: positions only
    assert "by_layer" not in step_sequence(kernels, 2, "gemv|attention|gemm", layers=3)


def test_prefill_anatomy_splits_a_kernel_profile_by_role_and_scope(tmp_path):
    """``prefill_anatomy`` reads Mosaic GPU's on-device profile (a Chrome trace: a trace per
    warpgroup of each program, cycles within a trace): each scope's share of its role's span,
    its count and cycles each, and the programs' start spread."""
    from jaxllm.benchmarks.prefill_anatomy import summarize_kernel_profile

    def scope(name, tid, begin, end):  # ts in kilo-cycles past the program's start (us)
        return [{"name": name, "ph": "B", "ts": begin, "pid": 1, "tid": tid},
                {"name": name, "ph": "E", "ts": end, "pid": 1, "tid": tid}]

    events = []
    for program, start in ((0, 100.0), (1, 103.0)):  # 3 warpgroups a program: tid 1 + 3p + wg
        for wg in (0, 1):
            events += scope("softmax", 1 + 3 * program + wg, start, start + 1.5)
            events += scope("pv", 1 + 3 * program + wg, start + 1.5, start + 2.0)
        events += scope("tables", 3 + 3 * program, start, start + 0.5)
        events += scope("v_released", 3 + 3 * program, start + 0.5, start + 2.0)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"displayTimeUnit": "ns", "traceEvents": events}))
    r = summarize_kernel_profile(str(path))
    assert r["programs"] == 2
    compute, memory = r["compute"], r["memory"]
    assert compute["mean_span_cycles"] == pytest.approx(2000)
    assert compute["scopes"]["softmax"]["share"] == pytest.approx(0.75)
    assert compute["scopes"]["pv"] == pytest.approx({"share": 0.25, "mean_count": 1,
                                                     "mean_cycles_each": 500})
    assert memory["scopes"]["v_released"]["share"] == pytest.approx(0.75)
    assert set(memory["scopes"]) == {"tables", "v_released"}
    assert r["program_start_us"] == pytest.approx({"min": 0.0, "p50": 1.5, "max": 3.0})


def test_latency_reports_back_to_back_steps_and_an_fp8_pool(tiny_config, tmp_path):
    """``bench latency`` end to end on the tiny model with an FP8 pool: each batch size has a
    waited and a back-to-back step, and the roofline counts one byte per KV element."""
    import jax
    import jax.numpy as jnp
    from jaxllm.benchmarks.latency import (
        device_busy_s,
        kv_bytes_per_token,
        roofline_s,
        traced_busy_s,
    )

    out = tmp_path / "lat.json"
    assert bench_main(["latency", *tiny_bench_args(tiny_config), "--batch-sizes", "1,4",
                       "--context-len", "32", "--iters", "3", "--warmup-iters", "1",
                       "--kv-cache-dtype", "fp8", "--bandwidth-gbps", "100",
                       "--output-json", str(out)]) in (0, None)
    r = json.loads(out.read_text())
    assert [row["batch_size"] for row in r["rows"]] == [1, 4]
    assert not any("device_step_ms" in row for row in r["rows"])
    # --device-time reads GPU kernels from a profiler trace: refused up front on the CPU
    with pytest.raises(SystemExit, match="needs a GPU"):
        bench_main(["latency", *tiny_bench_args(tiny_config), "--device-time"])
    # and a trace without a GPU's kernels is an error, never a zero
    trace_dir = tmp_path / "trace"
    jax.profiler.start_trace(str(trace_dir))
    jax.jit(lambda x: x * 2)(jnp.ones(4)).block_until_ready()
    jax.profiler.stop_trace()
    with pytest.raises(RuntimeError, match="no device kernels"):
        device_busy_s(str(trace_dir))
    with pytest.raises(RuntimeError, match="no device kernels"):  # int4_matmul, kernels, l2
        traced_busy_s(jax.jit(lambda x: x * 2), (jnp.ones(4),))
    for row in r["rows"]:
        assert row["back_to_back_step_ms"] > 0 and row["step_ms"] > 0
        assert row["back_to_back_pct_of_roofline"] == pytest.approx(
            100 * row["roofline_ms"] / row["back_to_back_step_ms"])
    cfg = type("C", (), {k: TINY_HF_CONFIG[k] for k in (
        "num_hidden_layers", "num_key_value_heads", "head_dim")})
    assert r["rows"][1]["roofline_ms"] == pytest.approx(
        1e3 * roofline_s(r["weight_bytes"], cfg, 1, 4, 32, 100))
    assert kv_bytes_per_token(cfg, 1) * 2 == kv_bytes_per_token(cfg, 2)


def test_write_checkpoint_round_trips_through_the_safetensors_loader(tiny_config, tmp_path):
    """benchmarks/write_checkpoint.py: a sharded HF checkpoint of a config's shape that
    load_model reads back with the same config and the written tensors."""
    import numpy as np
    from jaxllm.benchmarks.write_checkpoint import main as write_main
    from safetensors.numpy import load_file

    import jaxllm
    from jaxllm.model_config import ModelConfig

    out = tmp_path / "ckpt"
    assert write_main([tiny_config, str(out), "--shard-gib", str(40_000 / 2**30)]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).exists() for f in files)
    source = ModelConfig.from_hf_config(TINY_HF_CONFIG)
    model = jaxllm.load_model(str(out), dtype="bfloat16")
    assert model.config == source.replace(checkpoint_dtype="bfloat16")
    embed = load_file(out / index["weight_map"]["model.embed_tokens.weight"])[
        "model.embed_tokens.weight"]
    assert embed.astype(np.float32).std() > 0.01
    assert (np.asarray(model.params["embed_tokens"]["embedding"], np.float32)
            == embed.astype(np.float32)).all()


def test_kernel_sass_captures_triton_ir_and_finds_mma_loops():
    """benchmarks/kernel_sass.py without Triton's compiler: the decode kernel's Triton IR for
    sm_90 (FP8 pages) is captured from JAX's lowering, and the SASS parser finds a loop with
    MMA instructions by its backward branch (and ignores one without, unless asked for every
    loop)."""
    from jaxllm.benchmarks.kernel_sass import capture_attention, kernel_ttir, loops

    program, warps, stages = capture_attention("decode", "float8_e4m3fn", tokens=4, context=40)
    ttir = kernel_ttir(*program)
    assert "tt.func" in ttir and "f8E4M3FN" in ttir and (warps, stages) == (4, 3)
    sass = "\n".join([
        "        /*0010*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0020*/                   LDS.U8 R2, [R3] ;",
        "        /*0030*/                   HMMA.16816.F32 R4, R8, R12, R4 ;",
        "        /*0040*/              @P0 BRA 0x20 ;",
        "        /*0050*/                   FADD R5, R5, R6 ;",
        "        /*0060*/                   BRA 0x50 ;"])
    mma = {"start": "0x20", "instructions": 3,
           "opcodes": {"LDS.U8": 1, "HMMA.16816.F32": 1, "BRA": 1}}
    assert loops(sass) == [mma]
    assert loops(sass, mma_only=False) == [
        mma, {"start": "0x50", "instructions": 2, "opcodes": {"FADD": 1, "BRA": 1}}]


STEP_HLO = """HloModule jit_forward_after, entry_computation_layout={...}

%fused_add (p0: bf16[8,4096]) -> bf16[8,4096] {
  %p0 = bf16[8,4096]{1,0} parameter(0)
  ROOT %inner_fusion.3 = bf16[8,4096]{1,0} fusion(%p0), kind=kLoop, calls=%x
}

ENTRY %main.42 (params: bf16[4096,6144], x: bf16[8,4096]) -> (f32[8,128256], bf16[8,4096]) {
  %params = bf16[4096,6144]{1,0} parameter(0)
  %x = bf16[8,4096]{1,0} parameter(1)
  %fusion.1368 = bf16[8,4096]{1,0} fusion(%x), kind=kCustom, calls=%norm
  %gemm_fusion_dot.3 = f32[4,8,6144]{2,1,0} fusion(%fusion.1368, %params), kind=kCustom
  %pallas_call.12 = (f32[512,128]{1,0}, f32[512]{0}) custom-call(%x), \
custom_call_target="__gpu$xla.gpu.triton"
  %loop_add_fusion.1.2 = bf16[8,4096]{1,0} fusion(%x, %x), kind=kLoop, calls=%fused_add
  %bitcast.7 = bf16[8,1,4096]{2,1,0} bitcast(%loop_add_fusion.1.2)
  %copy.2 = bf16[8,4096]{0,1} copy(%x)
  %while.1 = (s32[]) while(%t), condition=%c, body=%b
  ROOT %tuple = (f32[8,128256]{1,0}, bf16[8,4096]{1,0}) tuple(%gemm_fusion_dot.3, %copy.2)
}
"""


def test_step_kernels_counts_the_entry_computations_launches():
    # benchmarks/step_kernels.py: fusions by name stem, custom calls by target, other
    # launching ops by opcode; a nested computation's fusion, bitcasts, tuples and
    # parameters are not launches of the step
    from jaxllm.benchmarks.step_kernels import count_kernels

    assert count_kernels(STEP_HLO) == {
        "fusion": 1, "gemm_fusion_dot": 1, "custom-call __gpu$xla.gpu.triton": 1,
        "loop_add_fusion": 1, "copy": 1, "while": 1}


def test_step_kernels_reads_xlas_thunk_sequence(tmp_path):
    from jaxllm.benchmarks.step_kernels import graph_structure

    sequence = tmp_path / "m.thunk_sequence_after_thunk_passes.txt"
    sequence.write_text(
        "000: kCommandBuffer [source | sink] \n"
        "    001: kCustomKernel [source | next=002 (1)] loop_add_fusion grid: [1, 1, 1]\n"
        "    002: kCustomKernel [prev=001 (1) | sink] paged_attention_decode grid: [2, 1, 4]\n"
        "001: kGemm [source | sink] custom-call.3\n"
        "002: kCommandBuffer [source | sink] \n"
        "    001: kCopy [source | sink] kCopy\n")
    assert graph_structure([str(sequence)]) == {
        "graphs": 2, "graph_commands": 3, "outside_graphs": 1}
    assert graph_structure([]) == {}


def test_step_kernels_digest_leaves_out_only_what_names_the_source():
    from jaxllm.benchmarks.step_kernels import program_digest

    def module(tree: str, line: int, op: str = "add") -> str:
        return (f'HloModule m\n\nFileNames\n1 "{tree}/jaxllm/models/llama.py"\n\n'
                "ENTRY %main (x: f32[4]) -> f32[4] {\n"
                "  %x = f32[4]{0} parameter(0)\n"
                f"  %k = f32[4]{{0}} custom-call(%x), custom_call_target=\"__gpu$xla.gpu.triton\", "
                f'backend_config={{grid_x = 8 : i32, ir = "ML\\EFR{tree}:{line}\\00", '
                f'name = "decode"}}, stack_frame_id={line}\n'
                f'  %h = f32[4]{{0}} custom-call(%k), custom_call_target="mosaic_gpu_v2", '
                f'backend_config="{tree}:{line}"\n'
                f"  ROOT %y = f32[4]{{0}} {op}(%h, %x), metadata={{op_name=\"jit(f)/{tree}\" "
                f"source_line={line}}}\n}}\n")

    same = program_digest(module("/tmp/old_tree", 10))
    assert program_digest(module("/work/main", 12)) == same  # moved source, same program
    assert program_digest(module("/work/main", 12, op="multiply")) != same


@needs_cuda_plugin
def test_step_kernels_compiles_the_engines_step_for_an_h200_without_one(tiny_config):
    from jaxllm.benchmarks import step_kernels

    result = step_kernels.run(step_kernels.parse_args(
        ["--model", tiny_config, "--quantization", "none,fp8", "--buckets", "1x1,4x16"]))
    counts = {(r["quantization"], r["rows"]): r for r in result["rows"]}
    # the tiny config's 2 layers: a decode step runs two Pallas kernels in each (Triton custom
    # calls: rope_kv_write, on by default since 420f32a for steps of <= 64 tokens, and the
    # decode kernel), the 16-token mixed step three (rope_kv_write and two attention kernels:
    # its head_dim 16 is not the Hopper prefill kernel's)
    triton = "custom-call __gpu$xla.gpu.triton"
    assert counts["none", 1]["by_kind"][triton] == 4
    # XLA's GPU thunks, the Pallas kernels among them: one command buffer (CUDA graph) for
    # the whole decode step, or (this suite turns command buffers off, as an eager engine
    # does) every launch outside one
    decode = counts["none", 1]
    graphs_on = "xla_gpu_enable_command_buffer=" not in os.environ.get("XLA_FLAGS", "")
    assert (decode["graphs"], decode["graph_commands"] > 0) == (int(graphs_on), graphs_on)
    assert decode["graph_commands"] + decode["outside_graphs"] >= decode["kernels"]
    assert counts["none", 4]["by_kind"][triton] == 6
    # FP8 adds each projection's per-token quantization
    for rows in (1, 4):
        assert counts["fp8", rows]["kernels"] > counts["none", rows]["kernels"]


def test_kernel_sass_captures_the_fp8_activation_kernels():
    # benchmarks/kernel_sass.py --kernel rmsnorm_fp8 | swiglu_fp8: their Triton IR for sm_90
    from jaxllm.benchmarks.kernel_sass import capture_activation_quant, kernel_ttir

    for kernel, dtype in (("rmsnorm_fp8", "bf16"), ("swiglu_fp8", "f32")):
        program, warps, stages = capture_activation_quant(kernel, tokens=4, hidden=256,
                                                          intermediate=512)
        ttir = kernel_ttir(*program)
        assert "tt.func" in ttir and "f8E4M3FN" in ttir and dtype in ttir, kernel
        assert (warps, stages) == (4, 1)



def test_command_buffer_log_counts_xlas_graph_updates(tmp_path):
    from jaxllm.benchmarks.command_buffer_log import main

    # XLA's own messages (command_buffer_thunk.cc), in both its older and newer wording
    log = tmp_path / "run.vlog"
    log.write_text("\n".join([
        "I1205 command_buffer_thunk.cc:290] Execute command buffer; num_executions=1",
        "### unrolled 1x1 same",
        "I1205 command_buffer_thunk.cc:260] Create/Update command buffer by recoding command "
        "buffer cmd sequence after 0 executions since last update; num_commands=40; "
        "updated_allocs=9; is_first_record=1; needs_update=0",  # the first record: not an update
        "I1205 command_buffer_thunk.cc:280] Recorded command buffer in 900 μs; num_commands=40",
        "I1205 command_buffer_thunk.cc:290] Execute command buffer; num_executions=1",
        "I1205 command_buffer_thunk.cc:260] Update command buffer on device #0 by recoding "
        "command buffer cmd sequence after 1 executions since last update; num_commands=40; "
        "updated_allocs=3",
        "I1205 command_executor.cc:480] Updated 40 commands in 110 μs (skipped 36 command "
        "updates)",
        "I1205 command_buffer_thunk.cc:280] Updated command buffer in 120 μs; num_commands=40",
        "I1205 command_buffer_thunk.cc:290] Execute command buffer; num_executions=1",
        "I1205 command_buffer_thunk.cc:260] Create/Update command buffer by recoding command "
        "buffer cmd sequence after 1 executions since last update; num_commands=7; "
        "updated_allocs=1; is_first_record=0; needs_update=1",
        "I1205 command_buffer_cmd.cc:410] Updated 7 commands in 25 μs (skipped 0 command "
        "updates)",
        "I1205 command_buffer_thunk.cc:280] Updated command buffer in 30 μs; num_commands=7",
        "I1205 command_buffer_thunk.cc:290] Execute command buffer; num_executions=1",
        "I1205 command_buffer_thunk.cc:290] Execute command buffer; num_executions=2",
        "I1205 command_buffer_thunk.cc:330] Evicted 2 command buffer thunk command buffers",
        "an unrelated line",
    ]))
    main([str(log), "--output-json", str(tmp_path / "s.json")])
    sections = json.loads((tmp_path / "s.json").read_text())["sections"]
    assert list(sections) == ["", "unrolled 1x1 same"] and sections[""]["executes"] == 1
    s = sections["unrolled 1x1 same"]
    assert (s["executes"], s["updates"], s["update_us"], s["evicted"]) == (4, 2, 150, 2)
    assert s["updated_allocs"] == {"1": 1, "3": 1} and s["update_us_per_execute"] == 37.5
    assert (s["commands_recorded"], s["commands_skipped"]) == (4 + 7, 36)
    assert s["by_size"] == {"7": {"updates": 1, "update_us": 30},
                            "40": {"updates": 1, "update_us": 120}}


def test_latency_stores_4bit_weights_n_major_under_the_hopper_switch(tiny_config, tmp_path,
                                                                      monkeypatch):
    """``bench latency -q awq`` under ``JAXLLM_INT4_HOPPER=on`` times the weights as the engine
    stores them (N-major, zero points centred in the scales' dtype: more bytes than the packed
    u8 zero points), not the packed ones; under "both" a step reads one layout, the packed."""
    weights = {}
    for setting in ("off", "on", "both"):
        monkeypatch.setenv("JAXLLM_INT4_HOPPER", setting)
        out = tmp_path / f"lat_{setting}.json"
        assert bench_main(["latency", *tiny_bench_args(tiny_config), "-q", "awq",
                           "--unroll-layers", "--batch-sizes", "1", "--context-len", "32",
                           "--iters", "2", "--warmup-iters", "1", "--bandwidth-gbps", "100",
                           "--output-json", str(out)]) in (0, None)
        weights[setting] = json.loads(out.read_text())["weight_bytes"]
    assert weights["on"] > weights["off"] == weights["both"]


def test_gc_start_up_counts_what_an_engine_leaves_for_the_collector(tiny_config, tmp_path):
    """``gc_start_up`` on the tiny model: tracked objects and a full collection's time after
    the imports, the model and the engine's cold start (its programs all compiled)."""
    from jaxllm.benchmarks import gc_start_up

    out = tmp_path / "gc.json"
    gc_start_up.main(["--model", tiny_config, "--max-num-seqs", "4",
                      "--max-num-batched-tokens", "32", "--output-json", str(out)])
    r = json.loads(out.read_text())
    assert [p["at"] for p in r["points"]] == ["imports", "model", "engine"]
    assert all(p["tracked"] > 0 and p["full_collection_ms"] > 0 for p in r["points"])
    assert r["programs"] > 0


def test_l2_prefetch_needs_a_gpu():
    from jaxllm.benchmarks import l2_prefetch

    with pytest.raises(SystemExit, match="needs a GPU"):
        l2_prefetch.main(["--shapes", "o", "--fractions", "1"])
