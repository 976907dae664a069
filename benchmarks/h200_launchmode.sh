#!/usr/bin/env bash
# One H200 (chain for benchmarks/gpu_chain.sh): the engine's batch-1 decode step, traced, with
# XLA's default command-buffer update mode and with SKIP_TEMP (the mode that halved a waited
# call's launch in the 2026-12-02 launch_anatomy run; it needs XLA's VMM allocator, under which
# JAX reports no memory statistics, hence the pool set by --num-gpu-blocks-override), for the
# Llama-3-8B AWQ int4 model (host-bound at batch 1: its device idles 57% of the step) and bf16:
#   p1 AWQ, default; p3 AWQ, SKIP_TEMP; p4 bf16, SKIP_TEMP; p2 bf16, default
#   JAXLLM_COMMIT=<commit> BUDGET=380 bash benchmarks/h200_launchmode.sh start &&
#     bash benchmarks/h200_launchmode.sh wait 390
HERE=$(dirname "${BASH_SOURCE[0]}")
ONE="--model llama-3-8b --load-format dummy --dtype bfloat16 --no-progress --dataset-name random
  --input-len 1024 --output-len 160 --num-prompts 2 --max-num-seqs 1 --max-num-batched-tokens 2048
  --num-gpu-blocks-override 2000 --unroll-layers --trace-steps 60:40 --host-profile-steps 110:40 --top 40"
SKIP="XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP"

steps() {
  # shellcheck disable=SC2086
  {
    step p1_awq_default 70 130 $PY -m jaxllm.benchmarks.step_profile $ONE --quantization awq --out-dir "$DIR/p1"
    step p3_awq_skip_temp 70 130 env $SKIP $PY -m jaxllm.benchmarks.step_profile $ONE --quantization awq \
      --out-dir "$DIR/p3"
    step p4_bf16_skip_temp 50 100 env $SKIP $PY -m jaxllm.benchmarks.step_profile $ONE --out-dir "$DIR/p4"
    step p2_bf16_default 50 100 $PY -m jaxllm.benchmarks.step_profile $ONE --out-dir "$DIR/p2"
    rm -rf "$DIR"/p*/trace
  }
  return 0
}

summary() {
  for log in "$DIR"/p*.log; do
    echo "${log##*/}"; grep -h "pass 1\|traced" "$log" 2>/dev/null | cut -c1-250
  done
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
