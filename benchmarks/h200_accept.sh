#!/usr/bin/env bash
# Issue 17's goals in one run on one H200 (chain for benchmarks/gpu_chain.sh), Llama-3-8B shape,
# dummy bf16, and this session's kernel changes against the tree before them (BEFORE, a second
# `git archive` unpacked at $BEFORE_TGZ), in order:
#   g0  the changed kernels' GPU tests; g1 the int4 GEMV (and its x-in-XLA and in-kernel split
#       sum modes) and tiled kernel at 1 and 16 tokens, each checked against the reference on the
#       device (the chain stops if either fails)
#   k1  kernels: decode at batch 64 x context 2048 (shuffled block tables, timed with the
#       program's dispatch) against the copy rate; prefill of 2k chunks over 0 / 2k / 8k cached
#       tokens against the matmul rate (config sweep at the first point)
#   k0  the same decode point on BEFORE
#   l1  decode step at batch 1 / 64 / 256, context 1024, waited and back to back; l0 on BEFORE
#   t1  offline sharegpt-like, 1000 prompts, 1024 / 8192, every step against its floor
#   s1  served through `jaxllm serve` at its defaults, rate inf (1000) and 10 req/s (300)
#   t2  offline random 512 in / 128 out, 1000 prompts, every step against its floor
#   p1  the 8B AWQ decode step at batch 1 in the engine, traced (as h200_profile.sh's p1)
#   i1  the tiled int4 kernel against XLA's dequantize + dot at 128 / 512 / 2048 tokens (the
#       engine takes XLA's path above 64 tokens: whether the kernel should take more)
#   x3  (when the budget still allows) Llama-3-70B AWQ int4 served on ONE H200 at rate inf (300
#       prompts) and 10 req/s (100), as h200_last.sh's x3
#   call 1:   JAXLLM_COMMIT=<commit> BUDGET=960 bash benchmarks/h200_accept.sh start &&
#             bash benchmarks/h200_accept.sh wait 560
#   call 2:   bash benchmarks/h200_accept.sh wait 400
#   ONLY17=all in front of `start`: issue 17's goals alone (g0 the Hopper prefill kernel's GPU
#   tests, k1 with its configs instead of Triton's sweep, a1 the prefill kernel's device time
#   (prefill_anatomy), then l1, t1, s1, t2; no BEFORE tree):
#   BUDGET=1300; or ONLY17="t1 s1" etc.: those steps; "w5" (not in all): issue 16's warm
#   restart from an orbax conversion of a locally written 8B checkpoint, cold then warm;
#   "p2" (not in all): a device trace of t1's first mixed steps (step_profile); "f8 t1f p2f
#   p3f" (not in all): issue 16's FP8 W8A8 offline (GEMM formulations, t1 in FP8, its traces);
#   "f8d": the FP8 projections alone against bf16's at 1 / 16 / 64 tokens, by device time;
#   "t1fk": FP8 W8A8 with the FP8 KV cache, offline; "t1fe" / "t1e": t1f / t1 with the
#   launch's remedies (staged batch, SKIP_TEMP command buffers);
#   "t1 t1f t1k t1a l16": issue 16's bf16 / FP8 / FP8 KV / AWQ offline and decode steps, one run;
#   "l8": FP8's decode steps at 1 / 8 / 64 rows, default and SKIP_TEMP command buffers, and bf16;
#   "m8": the FP8 MLP block as the engine runs it against its GEMMs writing bf16 and against the
#   one-pass SwiGLU + quantization kernel (fp8_mlp), after g8 (the FP8 activation kernels'
#   tests on the GPU); "t1fs": t1f through both FP8 activation kernels (the RMSNorm + and
#   SwiGLU + quantization ones, jaxllm.layers.fp8_kernels), "t1fx" t1f on XLA's passes
#   (neither kernel; both are the default); "l8k": their decode steps at 1 / 8 / 64
#   rows against XLA's passes: "m8 l8k t1f t1fs" is the A/B (~12 minutes); with issue
#   16's table, "m8 l8k t1 t1f t1fs t1k t1a l16" (~23 minutes of steps, BUDGET=1450); "i1d":
#   the tiled int4 kernel with one dot a step against XLA's path at 128 / 512 tokens; "i4":
#   the weight in XLA's int4 type through XLA's own fused GEMM against the engine's paths;
#   "cb": XLA's graph updates at batch 1 / 64, bf16 and AWQ (and AWQ with x in the GEMV, and
#   under SKIP_TEMP), the batch at a new or at one address (~6 minutes); "e1": the engine's
#   decode steps at 1 (bf16, AWQ) and 64 rows (bf16) with the step's batch staged in the
#   forward's temporaries (JAXLLM_STAGE_STEP_INPUT) against today's (~6 minutes); "e1t": the
#   same at 1 row under XLA's SKIP_TEMP command-buffer mode (~4 minutes); "i5": the Hopper int4
#   kernel's GPU tests (g9), then int4_matmul --hopper at 1 / 16 / 128 / 512 tokens (> 145 s:
#   cut after gate_up on 2026-12-05); "t1ah": g9, then the AWQ engine through it
#   (JAXLLM_INT4_HOPPER=on), offline and its decode steps at 1 / 64 / 256 rows (~4 minutes),
#   beside "t1a l16"; "t1ab": g9, then the AWQ engine with the packed words only
#   (JAXLLM_INT4_HOPPER=off) offline and its one-row step beside the default's ("auto"; ~5
#   minutes), beside "t1a"; "p1s": the AWQ batch-1 step traced (p1) with every projection's GEMV,
#   the LM head and the attention kernel timed by position in the step (--sequence); "p1l":
#   the same with every GEMV loading its step's words first (loads_first); "p1g": with
#   gate_up's loads first (the "gate_up_256" candidate table); "p1k": with the split-K sums in
#   the GEMV (splits_sum=last); "i6": the GEMVs
#   at 1 / 2 / 4 tokens (the table's, loads first, the candidate table, the N-major one);
#   "x1" / "x1h": Llama-3-70B AWQ's batch-1 decode step (bench latency; x1h on the N-major
#   weights); "x3": the same model served (~5.5 minutes); "lm": see launch_matrix; "b1": bf16 and AWQ
#   at one row (issue 16's AWQ goal alone, ~100 s); "lb": the
#   decode steps at 1 and 2 rows (bf16, AWQ, AWQ N-major); "lf": JAXLLM_INT4_FUSION's and
#   JAXLLM_ROPE_KV_KERNEL's compiled tests (g10), then the one-row steps of bf16 and AWQ
#   with and without them (~3 minutes); "p1f": the AWQ step with both traced by position;
#   "p1e": p1f with gate_up's and down's weights read evict-first; "ll": the one-row step's
#   launch with its buffers kept in place; "kt": batch-1 decode-attention configs and GEMV
#   candidate tables by device time; "l2": a GEMV with its weight already in L2; "gb": a grid
#   barrier inside one kernel against a kernel boundary; "nk": the N-major GEMV's configs
#   against the packed GEMV at one token (each step's comment below says more)
HERE=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=benchmarks/h200_serving.sh
source "$HERE/h200_serving.sh"   # served
# BLOCKS: the offline runs' pool (48,000 on the H200; an H100's 80 GB holds ~24,000 beside bf16)
A1="--max-num-seqs 1024 --max-num-batched-tokens 8192 --num-gpu-blocks-override ${BLOCKS:-48000} --unroll-layers"
SERVE_ENGINE="--num-gpu-blocks-override 48000 --unroll-layers"
BIG="--max-num-seqs 256 --max-num-batched-tokens 2048 --unroll-layers --quantization awq"
SERVE_FLAGS="--tokenizer .gpu_deps/tokenizer_128k.json"
LATENCY="-m jaxllm.benchmarks latency --model llama-3-8b --load-format dummy --dtype bfloat16
  --batch-sizes 1,64,256 --context-len 1024 --unroll-layers --iters 20 --no-progress"
KERNELS="-m jaxllm.benchmarks.kernels --acceptance --dispatch-included --no-jax --no-sweep"
TIMELINE="-m jaxllm.benchmarks.step_timeline --model llama-3-8b --load-format dummy
  --dtype bfloat16 --no-progress --num-prompts 1000 $A1"
ONE="--model llama-3-8b --load-format dummy --dtype bfloat16 --no-progress --dataset-name random
  --input-len 1024 --output-len 160 --num-prompts 2 --max-num-seqs 1 --max-num-batched-tokens 2048
  --num-gpu-blocks-override 2000 --unroll-layers --trace-steps 60:40 --host-profile-steps 110:40 --top 40"
# (bash -c strings below get these flag lists with their newlines turned into spaces: a newline
# there ends the command; l0 failed with "--batch-sizes: command not found" on 2026-12-03.)
BEFORE=/tmp/before_tree  # outside $DIR: not packed with the results

steps() {
  [ -n "${ONLY17:-}" ] && { only17; return 0; }
  rm -rf "$BEFORE" && mkdir -p "$BEFORE" && tar xzf "${BEFORE_TGZ:-.gpu_deps/before.tgz}" -C "$BEFORE"
  ln -s "$PWD/.gpu_deps" "$BEFORE/.gpu_deps"
  # shellcheck disable=SC2086
  {
    # The changed kernels compiled and checked on the GPU first: the rest needs them right.
    step g0_kernel_tests 60 150 $PY -m pytest -q -x -p no:cacheprovider -m gpu \
      tests/test_paged_attention_kernels.py tests/test_kv_cache_fp8.py tests/test_int4_kernel.py \
      -k "unpadded or head_dim_128 or launch_order or large_batch or long_chunks or decode_batch \
      or fp8 or splits_sums"
    step g1_int4_small_m 40 120 $PY -m jaxllm.benchmarks.int4_matmul --models 8b --tokens 1,16 \
      --gemv-modes --output-json "$DIR/g1_int4_small_m.json"
    if [ -f "$DIR/failed" ] || grep -q BAD "$DIR/g1_int4_small_m.log"; then
      echo "kernel checks failed: chain stopped" >> "$DIR/steps.txt"; return 0; fi
    step k1_kernels 90 200 $PY $KERNELS --budget-s 120 --no-prefill-reference --out "$DIR/k1_kernels.json"
    step k0_kernels_before 40 100 bash -c "cd $BEFORE && JAXLLM_COMMIT=${BEFORE_COMMIT:-} \
      $PY $KERNELS --no-prefill --out $DIR/k0_kernels_before.json"
    step l1_latency 50 100 $PY $LATENCY --output-json "$DIR/l1_latency.json"
    step l0_latency_before 50 100 bash -c "cd $BEFORE && JAXLLM_COMMIT=${BEFORE_COMMIT:-} \
      $PY ${LATENCY//$'\n'/ } --output-json $DIR/l0_latency_before.json"
    step t1_sharegpt 130 260 $PY $TIMELINE --dataset-name sharegpt-like \
      --output-json "$DIR/t1_sharegpt.json"
    export -f served
    step s1_served_defaults 150 300 bash -c "DIR=$DIR PY=$PY MODEL=llama-3-8b DTYPE=bfloat16 \
      N=1000 N_RATED=300 ENGINE='$SERVE_ENGINE' SERVE_FLAGS='$SERVE_FLAGS'; served s1 inf,10"
    step t2_random 130 260 $PY $TIMELINE --dataset-name random --input-len 512 --output-len 128 \
      --output-json "$DIR/t2_random.json"
    step p1_profile_awq_b1 70 150 $PY -m jaxllm.benchmarks.step_profile $ONE --quantization awq \
      --out-dir "$DIR/p1"
    rm -rf "$DIR"/p1/trace
    step i1_int4_large_m 90 150 $PY -m jaxllm.benchmarks.int4_matmul --models 8b \
      --tokens 128,512,2048 --with-xla --copies 8 --output-json "$DIR/i1_int4_large_m.json"
    step x3_served_70b_awq 280 330 bash -c "DIR=$DIR PY=$PY MODEL=llama-3-70b DTYPE=bfloat16 \
      N=300 N_RATED=100 ENGINE='$BIG' SERVE_FLAGS='$SERVE_FLAGS'; served x3 inf,10"
  }
  return 0
}

# Issue 17's goals at the tree's defaults (attention backend auto: the Hopper prefill kernel on
# the H200), the prefill kernel's configs timed beside Triton's default.
only17() {
  local only=" ${ONLY17/all/g0 k1 a1 l1 t1 s1 t2} "
  picked() { [[ $only == *" $1 "* ]]; }
  # shellcheck disable=SC2086
  {
    picked g0 && step g0_hopper_tests 60 200 $PY -m pytest -q -x -p no:cacheprovider -m gpu \
      tests/test_prefill_hopper.py tests/test_paged_attention_generation.py \
      -k "test_configs or long_chunk or hopper_prefill_kernel"
    if [ -f "$DIR/failed" ]; then echo "kernel checks failed: chain stopped" >> "$DIR/steps.txt"; return 0; fi
    # ~55 s since f31de8c lowers each timed call once a program (32 lowerings of the prefill
    # kernels took it past 280 s on 2026-12-04)
    picked k1 && step k1_kernels 90 280 $PY $KERNELS --budget-s 100 --no-prefill-sweep --no-prefill-reference \
      --hopper --out "$DIR/k1_kernels.json"
    # The prefill kernel's own device time (a trace), apart from the program's dispatch and
    # block plan
    picked a1 && step a1_prefill_anatomy 60 150 $PY -m jaxllm.benchmarks.prefill_anatomy \
      --no-kernel-profile --out-dir "$DIR/a1"
    rm -rf "$DIR"/a1/trace_*
    # XLA's own int4 GEMM with the group scales fused in (--xla-int4, xla_int4.py),
    # against the engine's paths; first in a chain, it also warms the machine up for t1
    picked i4 && step i4_xla_int4 60 ${I4_LIMIT:-200} $PY -m jaxllm.benchmarks.int4_matmul \
      --models 8b --shapes gate_up,down,qkv --tokens ${I4_TOKENS:-128,512,1} --with-xla --xla-int4 --copies 8 \
      --iters 20 \
      --output-json "$DIR/i4_xla_int4.json"
    # XLA's graphs (command buffers) at batch 1 and 64, bf16 and AWQ: how often each is
    # re-recorded before it runs and how many of its allocations moved, with the step's batch
    # newly transferred every call (as the engine's) and at one address (launch_anatomy's
    # --batch-buffer same): whether fixed input addresses would take that off the launch
    export -f graph_updates
    export -f decode_timeline launch_matrix
    # gm (with lm): the device's memory from the CUDA driver where XLA's VMM allocator (SKIP_TEMP)
    # keeps no statistics, the KV sizing's source under that mode; the loads-first GEMVs
    # compiled against the reference (~60 s)
    picked lm && step gm_session_gpu_tests 60 150 $PY -m pytest -q -x -p no:cacheprovider \
      -m gpu tests/test_device_memory.py tests/test_int4_kernel.py -k "device_memory or \
      real_driver or loading_each_step_first"
    picked lm && step lm_launch_matrix 300 560 bash -c "DIR=$DIR PY=$PY LM_SKIP='$LM_SKIP' \
      LM_CASES='${LM_CASES//$'\n'/ }' LM_ONLY='${LM_ONLY:-}' launch_matrix"
    export -f graph_updates_skip_temp
    picked cb && step cb_graph_updates 240 420 bash -c "DIR=$DIR PY=$PY graph_updates"
    # cb1: the AWQ batch-1 step alone, default then SKIP_TEMP (~3 minutes)
    picked cb1 && step cb1_graph_updates_awq 120 300 bash -c "DIR=$DIR PY=$PY CB_QUANTS=awq \
      CB_EXTRAS=skip_temp graph_updates"
    # The engine's small decode steps with the step's batch read from a copy in the forward's
    # temporaries (JAXLLM_STAGE_STEP_INPUT=on: one command of the step's graph reads the new
    # batch instead of ~130) against today's, off then on for each: bf16 and AWQ at one
    # sequence, bf16 at 64 (~6 minutes; what cb's "same" batch buffer bounds)
    # e1t: the same at one sequence under XLA's SKIP_TEMP update mode (the temporaries kept at
    # one address through XLA's VMM allocator), where staging leaves ~4 commands to re-record
    export -f staged_steps
    picked e1 && step e1_staged_step_input 300 480 bash -c "DIR=$DIR PY=$PY staged_steps"
    picked e1t && step e1t_staged_skip_temp 200 360 bash -c "DIR=$DIR PY=$PY \
      XLA_FLAGS='${XLA_FLAGS:-} --xla_gpu_command_buffer_update_mode=SKIP_TEMP' \
      E1_CONFIGS='bf16:1 awq:1' E1_TAG=skip_temp_ staged_steps"
    # the FP8 activation kernels compiled and checked against XLA's passes on the GPU (the
    # MLP, the norm, the o projection's input, and forwards through them)
    { picked m8 || picked l8k || picked t1fs || picked t1fx; } && step g8_fp8_kernel_tests 30 150 \
      $PY -m pytest -q -x -p no:cacheprovider \
      tests/test_activation_quant_kernels.py tests/test_rows_fp8_kernel.py
    picked m8 && step m8_fp8_mlp 40 150 $PY -m jaxllm.benchmarks.fp8_mlp --tokens 256,1024,2048,8192 \
      --output-json "$DIR/m8_fp8_mlp.json"
    # (before t1: the first engine run on a fresh machine ran its mixed steps ~14% slower,
    # 223 ms against 196 for t1k later in the same run, 2026-12-05)
    picked l1 && step l1_latency 50 100 $PY $LATENCY --output-json "$DIR/l1_latency.json"
    picked t1 && step t1_sharegpt 130 260 $PY $TIMELINE --dataset-name sharegpt-like \
      --output-json "$DIR/t1_sharegpt.json"
    export -f served
    picked s1 && step s1_served_defaults 150 300 bash -c "DIR=$DIR PY=$PY MODEL=llama-3-8b \
      DTYPE=bfloat16 N=1000 N_RATED=300 ENGINE='$SERVE_ENGINE' SERVE_FLAGS='$SERVE_FLAGS'; \
      served s1 inf,10"
    picked t2 && step t2_random 130 260 $PY $TIMELINE --dataset-name random --input-len 512 \
      --output-len 128 --output-json "$DIR/t2_random.json"
    # Where the offline run's mixed steps (the first ones: 8,192-token prefill chunks beside
    # decodes) spend their device time, kernel by kernel
    picked p2 && step p2_profile_mixed 90 200 $PY -m jaxllm.benchmarks.step_profile \
      ${TIMELINE#-m jaxllm.benchmarks.step_timeline} --dataset-name sharegpt-like \
      --trace-steps 3:6 --host-profile-steps 40:60 --top 40 --out-dir "$DIR/p2"
    rm -rf "$DIR"/p2/trace
    # Issue 16's FP8 W8A8 offline beside t1's bf16 (f8: the projection's formulations at the
    # engine's token counts; t1f: t1 with --quantization fp8; p2f / p3f: where its mixed and
    # small decode steps spend their device time)
    picked f8 && step f8_fp8_matmul 40 150 bash -c "$PY -m jaxllm.benchmarks.fp8_matmul \
      --tokens 1,8,16,32,64,128,256 --variants N,K --iters 30 --output-json $DIR/f8_gate_up.json \
      && $PY -m jaxllm.benchmarks.fp8_matmul --tokens 1,8,16,32,64,128,256 --variants N,K \
      --iters 30 --k 14336 --n 4096 --output-json $DIR/f8_down.json"
    # f8d: each FP8 projection of Llama-3-8B beside bf16's at the decode steps' token counts,
    # by the device's time over 8 distinct weights (how far cuBLASLt's FP8 GEMM is from
    # reading its weight at the HBM rate where the step is weight-bound; ~2.5 minutes)
    picked f8d && step f8d_fp8_projections_device 40 200 $PY -m jaxllm.benchmarks.fp8_matmul \
      --shapes qkv,o,gate_up,down --tokens 1,16,64 --variants "N,K] out bf" --device-time \
      --iters 5 --output-json "$DIR/f8d_fp8_projections.json"
    picked t1f && step t1f_sharegpt_fp8 150 300 $PY $TIMELINE --dataset-name sharegpt-like \
      --quantization fp8 --output-json "$DIR/t1f_sharegpt_fp8.json"
    # t1fe / t1e: t1f / t1 with the launch's remedies (the step's batch staged in the forward's
    # buffer; XLA's SKIP_TEMP command-buffer updates). On the H200 the small steps' launch
    # ("prepare", ~3.0 ms) nears their device time: FP8's 1-16-row steps ran 3.8 ms a step
    # against 3.3-3.4 ms of device time (2026-12-06); the remedies halved an H100's lone-step
    # launch (ll) but gained nothing in an H100's offline FP8 run (+0.3%, 363a071): the H200's
    # host is the open question
    local remedies="env JAXLLM_STAGE_STEP_INPUT=on XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
    picked t1fe && step t1fe_sharegpt_fp8_launch_remedies 150 300 $remedies $PY $TIMELINE \
      --dataset-name sharegpt-like --quantization fp8 \
      --output-json "$DIR/t1fe_sharegpt_fp8_launch_remedies.json"
    picked t1e && step t1e_sharegpt_launch_remedies 130 260 $remedies $PY $TIMELINE \
      --dataset-name sharegpt-like --output-json "$DIR/t1e_sharegpt_launch_remedies.json"
    # t1 again after t1f ("t1f t1b": bf16 second, so that the first-run effect above falls
    # on FP8 and FP8 / bf16 is not inflated by it)
    picked t1b && step t1b_sharegpt_after_fp8 130 260 $PY $TIMELINE --dataset-name sharegpt-like \
      --output-json "$DIR/t1b_sharegpt_after_fp8.json"
    # t1f with both FP8 activation kernels (jaxllm.layers.fp8_kernels): each RMSNorm with the
    # next projection's quantization, SwiGLU with the down projection's over the product dtype
    # m8 found faster (f32 when m8 did not run or XLA's passes won); l8k: their small decode
    # steps against XLA's passes (bench latency at 1 / 8 / 64 rows)
    local lat="${LATENCY//$'\n'/ }"  # one line (a newline in bash -c ends the command)
    local small="${lat/1,64,256/1,8,64}"
    if picked t1fs || picked t1fx || picked l8k; then
      # pytest's summary starts "N passed" only when nothing failed
      if ! grep -qE "^[0-9]+ passed" "$DIR"/g8_*.log 2>/dev/null; then
        echo "t1fs / l8k skipped: the kernels' GPU tests (g8) did not pass" >> "$DIR/steps.txt"
      else
        local swiglu
        swiglu=$($PY -m jaxllm.benchmarks.fp8_mlp --pick-from "$DIR/m8_fp8_mlp.json" 2>/dev/null)
        [ "$swiglu" = bf16 ] || swiglu=f32
        local kernels="env JAXLLM_FP8_NORM_KERNEL=on JAXLLM_FP8_SWIGLU_KERNEL=$swiglu"
        # (with the device's time: a slow host's launch must not decide; the norm kernel
        # alone too, as the SwiGLU one lost to XLA's passes in m8 until it held its row)
        picked l8k && step l8k_fp8_kernels_small 40 300 bash -c "JAXLLM_FP8_NORM_KERNEL=off \
          JAXLLM_FP8_SWIGLU_KERNEL=off $PY $small --device-time \
          -q fp8 --output-json $DIR/l8k_xla.json; JAXLLM_FP8_NORM_KERNEL=on \
          JAXLLM_FP8_SWIGLU_KERNEL=off $PY $small \
          --device-time -q fp8 --output-json $DIR/l8k_norm.json; $kernels $PY $small \
          --device-time -q fp8 --output-json $DIR/l8k_kernels_$swiglu.json"
        picked t1fs && step t1fs_sharegpt_fp8_kernels_$swiglu 150 300 $kernels $PY $TIMELINE \
          --dataset-name sharegpt-like --quantization fp8 \
          --output-json "$DIR/t1fs_sharegpt_fp8_kernels_$swiglu.json"
        # t1fx: t1f on XLA's passes (neither kernel: the norm one the default since f25b495,
        # the SwiGLU one since the row-in-registers kernel)
        picked t1fx && step t1fx_sharegpt_fp8_xla_passes 150 300 env JAXLLM_FP8_NORM_KERNEL=off \
          JAXLLM_FP8_SWIGLU_KERNEL=off \
          $PY $TIMELINE --dataset-name sharegpt-like --quantization fp8 \
          --output-json "$DIR/t1fx_sharegpt_fp8_xla_passes.json"
      fi
    fi
    # Issue 16's table in one run: t1 (bf16) and t1f (FP8 W8A8) above, t1k (FP8 KV cache),
    # t1a (AWQ int4, dummy, group 128); l16: their decode steps at batch 1 / 64 / 256
    picked t1k && step t1k_sharegpt_fp8_kv 150 300 $PY $TIMELINE --dataset-name sharegpt-like \
      --kv-cache-dtype fp8 --output-json "$DIR/t1k_sharegpt_fp8_kv.json"
    # t1fk: FP8 W8A8 over an FP8 KV cache (what a user after throughput runs: the 65-512-row
    # decode steps read as many bytes of bf16 KV as of FP8 weights, 2026-12-06 H100)
    picked t1fk && step t1fk_sharegpt_fp8_fp8_kv 150 300 $PY $TIMELINE --dataset-name sharegpt-like \
      --quantization fp8 --kv-cache-dtype fp8 --output-json "$DIR/t1fk_sharegpt_fp8_fp8_kv.json"
    picked t1a && step t1a_sharegpt_awq 150 300 $PY $TIMELINE --dataset-name sharegpt-like \
      --quantization awq --output-json "$DIR/t1a_sharegpt_awq.json"
    # (with the device's own time since 2026-12-06: a slow host's launch must not decide)
    picked l16 && step l16_latency_quant 60 360 bash -c "$PY $lat --device-time \
      --output-json $DIR/l16_bf16.json; $PY $lat -q awq --device-time \
      --output-json $DIR/l16_awq.json; $PY $lat -q fp8 --device-time \
      --output-json $DIR/l16_fp8.json; $PY $lat --kv-cache-dtype fp8 --device-time \
      --output-json $DIR/l16_fp8_kv.json"
    # b1: issue 16's AWQ goal alone: the one-row decode step of bf16 and of AWQ at the
    # defaults, waited, back to back and by the device's busy time (~100 s)
    picked b1 && step b1_latency_one_row 40 200 bash -c "$PY ${lat/1,64,256/1} --device-time \
      --output-json $DIR/b1_bf16.json; $PY ${lat/1,64,256/1} -q awq --device-time \
      --output-json $DIR/b1_awq.json"
    # lb: the one- and two-row decode steps (bench latency at batch 1 / 2): XLA compiles the
    # one-row program with 65 more launches (bf16; its RMSNorms unfused), so whether the
    # smallest decode bucket should be 2; bf16, AWQ, AWQ on the N-major weights (~2 minutes)
    local tiny="${lat/1,64,256/1,2} --device-time"  # the device's own ms too (a slow host)
    picked lb && step lb_latency_one_two_rows 40 240 bash -c "$PY $tiny --output-json $DIR/lb_bf16.json; \
      $PY $tiny -q awq --output-json $DIR/lb_awq.json; JAXLLM_INT4_HOPPER=on $PY $tiny -q awq \
      --output-json $DIR/lb_awq_nk.json"
    # FP8's small decode steps, waited and back to back, under XLA's default and SKIP_TEMP
    # command buffers; bf16 beside
    picked l8 && step l8_fp8_small 40 330 bash -c "$PY $small -q fp8 --output-json $DIR/l8_w8a8.json; \
      XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP $PY $small -q fp8 \
      --output-json $DIR/l8_skip_temp.json; $PY $small --output-json $DIR/l8_bf16.json"
    # the tiled int4 kernel with one dot a step (never timed) against XLA's dequantize + dot
    # at the AWQ engine's mid-size steps (XLA's path above 64 tokens: 1.6-2.1x bf16's steps)
    # The Hopper int4 kernel (Mosaic GPU, the weight as wgmma's register operand; first run on
    # the H200 on 2026-12-05 at 16beaaf): its GPU tests (g9), then, only when they passed, i5
    # (timed beside bf16 and XLA's path at the AWQ engine's decode and mid-size steps) and
    # t1ah (the AWQ engine through it); "t1ah" alone skips i5's ~150 s
    if picked i5 || picked t1ah || picked i6 || picked t1ab; then
      step g9_int4_hopper_tests 60 200 $PY -m pytest -q -x -p no:cacheprovider -m gpu \
        tests/test_int4_hopper.py tests/test_int4_gemv_nk.py
    fi
    if grep -qE "^[0-9]+ passed" "$DIR"/g9_*.log 2>/dev/null; then
      # i6: the GEMVs at 1 / 2 / 4 tokens in one process: the table's, loads first, the
      # candidate table, and the GEMV over the N-major weight beside the Hopper kernel (~90 s)
      picked i6 && step i6_int4_gemvs 60 240 $PY -m jaxllm.benchmarks.int4_matmul --models 8b \
        --shapes qkv,o,gate_up,down --tokens 1,2,4 --hopper --gemv-modes --copies 8 --iters 20 \
        --output-json "$DIR/i6_int4_gemvs.json"
      picked i5 && step i5_int4_hopper 60 300 $PY -m jaxllm.benchmarks.int4_matmul --models 8b \
        --shapes gate_up,down,qkv --tokens 1,16,128,512 --with-xla --hopper --hopper-sweep \
        --copies 8 --iters 20 --output-json "$DIR/i5_int4_hopper.json"
      # the AWQ engine with every projection through it (JAXLLM_INT4_HOPPER=on: the weights
      # stored N-major at load): offline, and the decode steps at 1 / 64 / 256 rows
      picked t1ah && step t1ah_sharegpt_awq_hopper 150 300 env JAXLLM_INT4_HOPPER=on $PY \
        $TIMELINE --dataset-name sharegpt-like --quantization awq \
        --output-json "$DIR/t1ah_sharegpt_awq_hopper.json"
      picked t1ah && step l16h_latency_awq_hopper 40 200 bash -c "JAXLLM_INT4_HOPPER=on \
        $PY ${LATENCY//$'\n'/ } -q awq --output-json $DIR/l16h_awq_hopper.json"
      # t1ab: the AWQ engine with the packed words only (JAXLLM_INT4_HOPPER=off, the default
      # until 2026-12-07) offline beside t1a (the default, "auto": on a Hopper GPU both
      # layouts, the GEMV's 1-16 tokens on the packed words, 17-512 on the N-major copy, more
      # on the packed words through XLA); then the one-row AWQ step by device time under
      # both settings, one process each
      picked t1ab && step t1ab_sharegpt_awq_packed 150 300 env JAXLLM_INT4_HOPPER=off $PY \
        $TIMELINE --dataset-name sharegpt-like --quantization awq \
        --output-json "$DIR/t1ab_sharegpt_awq_packed.json"
      picked t1ab && step b1ab_latency_awq_one_row 40 200 bash -c "JAXLLM_INT4_HOPPER=off \
        $PY ${lat/1,64,256/1} -q awq --device-time --output-json $DIR/b1ab_awq_packed.json; \
        $PY ${lat/1,64,256/1} -q awq --device-time --output-json $DIR/b1ab_awq.json"
    fi
    picked p1s && step p1s_profile_awq_b1_sequence 70 150 $PY -m jaxllm.benchmarks.step_profile $ONE \
      --quantization awq --sequence "gemv|gemm|attention" --out-dir "$DIR/p1s"
    rm -rf "$DIR"/p1s/trace
    # p1l: p1s with every GEMV loading its step's words first (the "loads_first" candidate
    # table; down on the denormal loop too): each projection's device time against p1s's
    picked p1l && step p1l_profile_awq_b1_loads_first 70 150 $PY -m jaxllm.benchmarks.step_profile \
      $ONE --quantization awq --sequence "gemv|gemm|attention" --gemv-overrides "$LOADS_FIRST" \
      --out-dir "$DIR/p1l"
    rm -rf "$DIR"/p1l/trace
    # p1g: p1s with gate_up's loads first at 96 registers (int4_configs' "gate_up_256")
    picked p1g && step p1g_profile_awq_b1_gate_up 70 150 $PY -m jaxllm.benchmarks.step_profile \
      $ONE --quantization awq --sequence "gemv|gemm|attention" --gemv-overrides table=gate_up_256 \
      --out-dir "$DIR/p1g"
    rm -rf "$DIR"/p1g/trace
    # p1k: p1s with the split-K partials summed by each column block's last split, in the GEMV
    # (splits_sum=last: 584 -> 491 launches a step; 152 input_reduce_fusions a step took 0.28 ms
    # of the H100's 3.15 on 2026-12-06)
    picked p1k && step p1k_profile_awq_b1_last_split 70 150 $PY -m jaxllm.benchmarks.step_profile \
      $ONE --quantization awq --sequence "gemv|gemm|attention" --gemv-overrides splits_sum=last \
      --out-dir "$DIR/p1k"
    rm -rf "$DIR"/p1k/trace
    # JAXLLM_INT4_FUSION (the residual add + RMSNorm + GEMV-input kernel and the attention's
    # merge writing o's input: 584 -> 488 launches at one row) and JAXLLM_ROPE_KV_KERNEL (RoPE
    # and the K/V write in one kernel: 63 fewer, any format; both: 425): g10 their compiled tests; lf the one-row decode steps of bf16 (and with
    # the RoPE kernel), AWQ, AWQ fused, AWQ fused with the RoPE kernel, with the device's busy
    # time (~2 minutes); p1f p1s's trace with both (each kernel by position)
    if picked lf || picked p1f || picked p1e; then
      step g10_fusion_tests 60 150 $PY -m pytest -q -x -p no:cacheprovider -m gpu \
        tests/test_int4_fusion.py tests/test_rope_kv_write.py
    fi
    if grep -qE "^[0-9]+ passed" "$DIR"/g10_*.log 2>/dev/null; then
      local one="${LATENCY//$'\n'/ }"
      one="${one/1,64,256/1} --device-time"
      local both="JAXLLM_INT4_FUSION=on JAXLLM_ROPE_KV_KERNEL=on"  # the defaults since 2026-12-06
      local none="JAXLLM_INT4_FUSION=off JAXLLM_ROPE_KV_KERNEL=off"
      picked lf && step lf_latency_fusion 40 300 bash -c "env $none $PY $one \
        --output-json $DIR/lf_bf16.json; env $both $PY $one --output-json $DIR/lf_bf16_rope.json; \
        env $none $PY $one -q awq --output-json $DIR/lf_awq.json; \
        env $none JAXLLM_INT4_FUSION=on $PY $one -q awq --output-json $DIR/lf_awq_fused.json; \
        env $both $PY $one -q awq --output-json $DIR/lf_awq_fused_rope.json"
      picked p1f && step p1f_profile_awq_b1_fused 70 150 env $both $PY \
        -m jaxllm.benchmarks.step_profile $ONE --quantization awq \
        --sequence "gemv|gemm|attention|rmsnorm|rope" --out-dir "$DIR/p1f"
      rm -rf "$DIR"/p1f/trace
      # p1e: p1f with gate_up's and down's weights read evict-first (int4_configs' "evict")
      picked p1e && step p1e_profile_awq_b1_evict 70 150 env $both $PY \
        -m jaxllm.benchmarks.step_profile $ONE --quantization awq --gemv-overrides table=evict \
        --sequence "gemv|gemm|attention|rmsnorm|rope" --out-dir "$DIR/p1e"
      rm -rf "$DIR"/p1e/trace
    fi
    # ll: the one-row step's launch with its commands' buffers kept in place, bf16 and AWQ at
    # the defaults: as is; the batch staged (JAXLLM_STAGE_STEP_INPUT); staged with the
    # temporaries in their own stream-ordered pool (XLA's temp_buffer_use_separate_color: the
    # same address every step, BFC statistics kept); staged under SKIP_TEMP (VMM) (~3 minutes)
    if picked ll; then
      local one="${LATENCY//$'\n'/ }"
      one="${one/1,64,256/1} --device-time"
      local color="--xla_gpu_temp_buffer_use_separate_color=true"
      local skip="--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
      step ll_launch_in_place 60 330 bash -c "for q in bf16 awq; do \
        quant=\$( [ \$q = awq ] && echo '-q awq' ); \
        $PY $one \$quant --output-json $DIR/ll_\${q}.json; \
        JAXLLM_STAGE_STEP_INPUT=on $PY $one \$quant --output-json $DIR/ll_\${q}_staged.json; \
        JAXLLM_STAGE_STEP_INPUT=on XLA_FLAGS='$color' $PY $one \$quant \
          --output-json $DIR/ll_\${q}_staged_color.json; \
        JAXLLM_STAGE_STEP_INPUT=on XLA_FLAGS='$skip' $PY $one \$quant \
          --output-json $DIR/ll_\${q}_staged_skip_temp.json; done"
    fi
    # kt: batch-1 kernel candidates timed alone: the decode attention's key blocks and splits
    # over one sequence of 1,024 tokens (kernels' sweep), gate_up's and down's GEMV candidate
    # tables (int4_configs), each by its device time in a profiler trace (~4 minutes)
    picked kt && step kt_decode_b1_sweep 60 200 $PY -m jaxllm.benchmarks.kernels --acceptance \
      --no-prefill --no-jax --sweep-points 1:1024 --device-time --out "$DIR/kt_decode_b1.json"
    picked kt && step kt_gemv_candidates 60 240 $PY -m jaxllm.benchmarks.int4_matmul --models 8b \
      --shapes gate_up,down --tokens 1 --gemv-modes --copies 8 --device-time \
      --output-json "$DIR/kt_gemv.json"
    # l2: a one-token GEMV's device time with its weight just read into L2 by an XLA reduction
    # against after another weight's (l2_prefetch: the bound of reading the next projection's
    # weight during the attention's window; ~2 minutes)
    picked l2 && step l2_prefetch 60 240 bash -c "$PY -m jaxllm.benchmarks.l2_prefetch \
      --shapes o,qkv,down --fractions 1,0.5 --output-json $DIR/l2_small.json && \
      $PY -m jaxllm.benchmarks.l2_prefetch --shapes gate_up --fractions 0.5,0.25 \
      --output-json $DIR/l2_gate_up.json"
    # gb: a grid barrier inside one Pallas kernel against a kernel boundary (its GPU tests
    # first; grid_barrier.py: the Llama-3-8B AWQ layer's four weights' bytes a layer as
    # phases, one program an SM; ~1 minute)
    picked gb && step gb_grid_barrier 40 200 bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_grid_barrier.py && $PY -m jaxllm.benchmarks.grid_barrier --layers 4 \
      --output-json $DIR/gb_grid_barrier.json && $PY -m jaxllm.benchmarks.grid_barrier \
      --layers 4 --phase-mb 1,1,1,1 --output-json $DIR/gb_small_phases.json"
    # nk: the N-major GEMV (JAXLLM_INT4_HOPPER's 1-4 tokens) under NK_GEMV_SWEEP's configs
    # beside the packed GEMV, one token, by device time (~1.5 minutes)
    picked nk && step nk_gemv_sweep 40 200 $PY -m jaxllm.benchmarks.int4_matmul --models 8b \
      --tokens 1 --hopper --nk-sweep --copies 8 --device-time --output-json "$DIR/nk_gemv_sweep.json"
    picked i1d && step i1d_int4_one_dot 60 200 $PY -m jaxllm.benchmarks.int4_matmul --models 8b \
      --shapes gate_up,down --tokens 128,512 --with-xla --one-dot --copies 8 \
      --output-json "$DIR/i1d_int4_one_dot.json"
    picked p2f && step p2f_profile_fp8_mixed 60 200 $PY -m jaxllm.benchmarks.step_profile \
      ${TIMELINE#-m jaxllm.benchmarks.step_timeline} --dataset-name sharegpt-like --quantization fp8 \
      --trace-steps 3:6 --host-profile-steps 40:60 --top 30 --out-dir "$DIR/p2f"
    picked p3f && step p3f_profile_fp8_tail 60 200 $PY -m jaxllm.benchmarks.step_profile \
      ${TIMELINE#-m jaxllm.benchmarks.step_timeline} --dataset-name sharegpt-like --quantization fp8 \
      --trace-steps 820:40 --host-profile-steps 700:60 --top 30 --out-dir "$DIR/p3f"
    rm -rf "$DIR"/p2f/trace "$DIR"/p3f/trace
    if picked w5; then  # issue 16's warm restart from a converted checkpoint (as h200_next's)
      local hf=/tmp/llama-3-8b-hf orbax=/tmp/llama-3-8b-hf-orbax
      rm -rf "$hf" "$orbax"
      step w2_write_hf 60 200 $PY -m jaxllm.benchmarks.write_checkpoint llama-3-8b "$hf"
      step w4_convert 60 200 $PY -m jaxllm convert "$hf" "$orbax" --unroll-layers
      step w5_restart_orbax 60 240 $PY -m jaxllm.benchmarks.warm_restart --starts cold,warm \
        --max-num-seqs 256 --max-num-batched-tokens 2048 --model "$orbax" \
        --output-json "$DIR/w5_restart_orbax.json"
      rm -rf "$hf" "$orbax"
    fi
    # Issue 16's Llama-3-70B AWQ on one H200: x1 the batch-1 decode step against its roofline
    # (bench latency; x1h the same on the N-major weights: gemv_nk), x3 served (~5.5 minutes)
    local lat70="${LATENCY//$'\n'/ }"
    lat70="${lat70/llama-3-8b/llama-3-70b}"
    lat70="${lat70/1,64,256/1}"
    picked x1 && step x1_latency_70b_awq 90 240 bash -c "$PY $lat70 -q awq \
      --output-json $DIR/x1_latency_70b_awq.json"
    picked x1h && step x1h_latency_70b_awq_nk 90 240 bash -c "JAXLLM_INT4_HOPPER=on \
      $PY $lat70 -q awq --output-json $DIR/x1h_latency_70b_awq_nk.json"
    export -f served
    picked x3 && step x3_served_70b_awq 280 330 bash -c "DIR=$DIR PY=$PY MODEL=llama-3-70b \
      DTYPE=bfloat16 N=300 N_RATED=100 ENGINE='$BIG' SERVE_FLAGS='$SERVE_FLAGS'; served x3 inf,10"
  }
  return 0
}

# e1: one engine process per (weights, rows, staging); step_timeline's bins give the steps' ms
# The engine's decode steps of one random 1,024-token workload (160 tokens out) at ROWS
# sequences, PROMPTS of them: step_timeline's bins (e1 and lm; the caller's environment sets
# the switches compared)
decode_timeline() {
  local rows=$1 prompts=$2 out=$3; shift 3
  $PY -m jaxllm.benchmarks.step_timeline --model llama-3-8b --load-format dummy \
    --dtype bfloat16 --no-progress --dataset-name random --input-len 1024 --output-len 160 \
    --num-prompts "$prompts" --max-num-seqs "$rows" --max-num-batched-tokens 2048 \
    --num-gpu-blocks-override 6000 --unroll-layers "$@" --output-json "$out"
}

staged_steps() {
  local config q rows prompts stage
  for config in ${E1_CONFIGS:-bf16:1 awq:1 bf16:64}; do
    q=${config%:*} rows=${config#*:} prompts=$(( ${config#*:} == 1 ? 4 : 64 ))
    local quant=()
    [ "$q" = awq ] && quant=(--quantization awq)
    for stage in off on; do
      JAXLLM_STAGE_STEP_INPUT=$stage decode_timeline "$rows" "$prompts" \
        "$DIR/e1_${E1_TAG:-}${q}_b${rows}_stage_$stage.json" "${quant[@]}"
    done
  done
}

# lm: the engine's one-sequence decode steps (step_timeline's bins, one process a case) under
# the launch's remedies, one at a time and together: the batch staged
# (JAXLLM_STAGE_STEP_INPUT=on), XLA's SKIP_TEMP command buffers (temporaries at one address
# through its VMM allocator), the GEMV's split sums in the kernel (splits_sum=last: 124 fewer
# launches) and x read by the GEMV (x_in_kernel: 32 more fewer); a case is
# TAG:QUANT:STAGE:SKIP_TEMP:GEMV_OVERRIDES ("-" for none), the likeliest remedies first
LM_SKIP="--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
# every GEMV loading its step's words before the first FMA (int4_configs' candidate table
# "loads_first"; shapes it does not list: the pick with loads_first)
LOADS_FIRST="table=loads_first,loads_first=True"
LM_CASES="awq_default:awq:off:no:- awq_skip_stage:awq:on:yes:-
  awq_skip_stage_last:awq:on:yes:splits_sum=last bf16_default:bf16:off:no:-
  awq_skip_stage_lf:awq:on:yes:$LOADS_FIRST awq_lf:awq:off:no:$LOADS_FIRST
  awqnk_skip_stage:awqnk:on:yes:- awqnk_default:awqnk:off:no:-
  awqnk_skip_stage_lx:awqnk:on:yes:nk.splits_sum=last,nk.x_in_kernel=True
  bf16_skip_stage:bf16:on:yes:- awq_stage:awq:on:no:- awq_default_last:awq:off:no:splits_sum=last
  awq_skip_stage_last_x:awq:on:yes:splits_sum=last,x_in_kernel=True"
launch_matrix() {
  local case tag q stage skip gemv
  for case in ${LM_ONLY:-$LM_CASES}; do
    IFS=: read -r tag q stage skip gemv <<< "$case"
    local extra=() flags="${XLA_FLAGS:-}" hopper=off
    [ "$q" = awq ] && extra+=(--quantization awq)
    # awqnk: the weights N-major (JAXLLM_INT4_HOPPER=on): 1-4 tokens through gemv_nk
    [ "$q" = awqnk ] && extra+=(--quantization awq) && hopper=on
    [ "$gemv" != "-" ] && extra+=(--gemv-overrides "$gemv")
    [ "$skip" = yes ] && flags="$flags $LM_SKIP"
    echo "== $tag" >> "$DIR/lm_cases.txt"
    XLA_FLAGS="$flags" JAXLLM_STAGE_STEP_INPUT=$stage JAXLLM_INT4_HOPPER=$hopper \
      decode_timeline 1 2 "$DIR/lm_$tag.json" \
      "${extra[@]}" > "$DIR/lm_$tag.log" 2>&1
    grep -h "^decode 1-16\|^total\|^host ms" "$DIR/lm_$tag.log" >> "$DIR/lm_cases.txt"
  done
}

# launch_anatomy under XLA's command-buffer log, one process per weight format; the log is
# summarized (command_buffer_log) and only its last lines kept. The command executor's own
# count (commands re-recorded and skipped) is logged from one of two files by jaxlib version.
CB_VMODULE=command_buffer_thunk=3,command_executor=1,command_buffer_cmd=1,command_buffer_cmd_executor=1
graph_updates() {
  local q
  for q in ${CB_QUANTS:-bf16 awq}; do
    local quant="" log="$DIR/cb_$q.vlog"
    [ "$q" = awq ] && quant="--quantization awq"
    # shellcheck disable=SC2086
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=$CB_VMODULE $PY -m \
      jaxllm.benchmarks.launch_anatomy --variants unrolled --buckets 1x1,64x1 --iters 30 \
      --batch-buffer fresh,same $quant --output-json "$DIR/cb_launch_$q.json" 2> "$log"
    $PY -m jaxllm.benchmarks.command_buffer_log "$log" --output-json "$DIR/cb_graphs_$q.json"
    tail -n 40 "$log" > "$DIR/cb_$q.vlog_tail" && rm -f "$log"
  done
  # the GEMV reading x itself (128 fewer kernels) made the engine's AWQ batch-1 step slower on
  # the host, 9.2 against 5.2 ms (2026-12-03), for a reason not found: its graph updates
  if [[ " ${CB_EXTRAS:-x skip_temp} " == *" x "* ]]; then
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=$CB_VMODULE $PY -m \
      jaxllm.benchmarks.launch_anatomy --variants unrolled --buckets 1x1 --iters 30 \
      --batch-buffer fresh,same --quantization awq --gemv-overrides x_in_kernel=True \
      --output-json "$DIR/cb_launch_awq_x.json" 2> "$DIR/cb_awq_x.vlog"
    $PY -m jaxllm.benchmarks.command_buffer_log "$DIR/cb_awq_x.vlog" \
      --output-json "$DIR/cb_graphs_awq_x.json"
    tail -n 40 "$DIR/cb_awq_x.vlog" > "$DIR/cb_awq_x.vlog_tail" && rm -f "$DIR/cb_awq_x.vlog"
  fi
  graph_updates_skip_temp
}

graph_updates_skip_temp() {
  [[ " ${CB_EXTRAS:-x skip_temp} " == *" skip_temp "* ]] || return 0
  # XLA's SKIP_TEMP update mode ignores moved temporaries: with the batch at a new and at one
  # address, the 2 x 2 with the default above says which moved allocations cost the launch
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_command_buffer_update_mode=SKIP_TEMP" \
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=$CB_VMODULE $PY -m \
    jaxllm.benchmarks.launch_anatomy --variants unrolled --buckets 1x1 --iters 30 \
    --batch-buffer fresh,same --quantization awq \
    --output-json "$DIR/cb_launch_awq_skip_temp.json" 2> "$DIR/cb_awq_skip_temp.vlog"
  $PY -m jaxllm.benchmarks.command_buffer_log "$DIR/cb_awq_skip_temp.vlog" \
    --output-json "$DIR/cb_graphs_awq_skip_temp.json"
  tail -n 40 "$DIR/cb_awq_skip_temp.vlog" > "$DIR/cb_awq_skip_temp.vlog_tail"
  rm -f "$DIR/cb_awq_skip_temp.vlog"
}

summary() {
  grep -h -A 12 "^NVIDIA\|^H200\|copy .* TB/s" "$DIR"/k*.log 2>/dev/null | cut -c1-160 | head -30
  grep -h "b2b\|roofline" "$DIR"/l*.log 2>/dev/null | cut -c1-200 | head -20
  grep -h "^total\|^wall" "$DIR"/t*.log 2>/dev/null | cut -c1-200
  $PY -m jaxllm.benchmarks.chain_summary "$DIR" 2>/dev/null
  grep -h "pass 1\|traced" "$DIR"/p1*.log 2>/dev/null | cut -c1-250
  grep -h "pass 1\|traced" "$DIR"/p2*.log "$DIR"/p3*.log 2>/dev/null | cut -c1-250
  grep -h "x  \|variant\|block" "$DIR"/f8*.log "$DIR"/m8*.log 2>/dev/null | cut -c1-120
  grep -h "^decode\|^mixed" "$DIR"/t1f*.log 2>/dev/null | cut -c1-200
  grep -h "b2b\|roofline" "$DIR"/l8k*.log 2>/dev/null | cut -c1-200
  grep -h "ready" "$DIR"/w5*.log 2>/dev/null | cut -c1-250
  grep -h "^unrolled\|^---\|^graph executions" "$DIR"/cb_*.log 2>/dev/null | cut -c1-200
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
