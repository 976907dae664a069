#!/usr/bin/env bash
# Issue 17's tail steps are bound by the forward's launch (1-5 ms of host a step). XLA re-records
# its command buffers (CUDA graphs) whenever a buffer address changes, and every engine step
# brings a new batch buffer; the VA-remapping update modes keep addresses stable instead.
# Chain for benchmarks/gpu_chain.sh, one H200, Llama-3-8B shape, dummy bf16:
#   c1     the compiled kernels over FP8 KV pages against the reference (GPU tests)
#   c2-c5  an 8B decode step's launch, one at a time and back to back, under XLA's
#          command-buffer modes: default (ALWAYS_UPDATE), SKIP_PROFILED, SKIP_TEMP, off
#   c6/c7  offline sharegpt-like, 1000 prompts, 1024 / 8192: default, and the mode with the
#          shortest back-to-back steps in c2-c5
#   JAXLLM_COMMIT=<commit> BUDGET=600 bash benchmarks/h200_cmdbuf.sh start &&
#   bash benchmarks/h200_cmdbuf.sh wait 540
HERE=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=benchmarks/h200_structured.sh
source "$HERE/h200_structured.sh"   # throughput
ENGINE="--max-num-seqs 1024 --max-num-batched-tokens 8192 --num-gpu-blocks-override 48000 --unroll-layers"
ANATOMY="-m jaxllm.benchmarks.launch_anatomy --variants unrolled --buckets 1x1,64x1 --iters 30"
MODES=("default:" "skip_profiled:--xla_gpu_command_buffer_update_mode=SKIP_PROFILED"
       "skip_temp:--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
       "off:--xla_gpu_enable_command_buffer=")

# The XLA_FLAGS of the c2-c5 mode with the smallest summed back-to-back step (default if none).
best_flags() {
  $PY - "$DIR" <<'PY'
import glob, json, sys
best = (float("inf"), "")
for path in glob.glob(f"{sys.argv[1]}/c*_launch_*.json"):
    rows = json.load(open(path)).get("rows", [])
    if len(rows) == 2:
        best = min(best, (sum(r["back_to_back_step_ms"] for r in rows),
                          json.load(open(path))["xla_flags"]))
print(best[1])
PY
}

steps() {
  # shellcheck disable=SC2086
  {
    step c1_fp8_pages 30 90 $PY -m pytest tests/test_kv_cache_fp8.py -k gpu -p no:cacheprovider \
      -W ignore::DeprecationWarning -rA
    local i=2
    for mode in "${MODES[@]}"; do
      step "c${i}_launch_${mode%%:*}" 40 90 env XLA_FLAGS="${mode#*:}" $PY $ANATOMY \
        --output-json "$DIR/c${i}_launch_${mode%%:*}.json"
      i=$((i + 1))
    done
    throughput c6_sharegpt_default 150 220 --dataset-name sharegpt-like --num-prompts "$N"
    local flags; flags=$(best_flags)
    echo "best command-buffer flags: '${flags}'" >> "$DIR/steps.txt"
    if [ -n "$flags" ]; then
      export XLA_FLAGS="$flags"
      throughput c7_sharegpt_best 150 220 --dataset-name sharegpt-like --num-prompts "$N"
      unset XLA_FLAGS
    fi
  }
  return 0
}

summary() { $PY -m jaxllm.benchmarks.chain_summary "$DIR" 2>/dev/null; grep -h "^unrolled" "$DIR"/c*_launch_*.log; }

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
