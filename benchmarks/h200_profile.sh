#!/usr/bin/env bash
# Evidence before this session's changes (chain for benchmarks/gpu_chain.sh, one GPU):
#   p1  the Llama-3-8B AWQ decode step at batch 1 traced (one sequence, 1024 + 160 tokens):
#       which kernels, how long each, and whether the device idles between steps (launch-bound)
#   p2  the same step in bf16
#   t1  the whole offline run's steps by size against their cost floors (bf16, a1's flags)
#   a5  Llama-3-8B shape, AWQ int4, offline sharegpt-like, 1000 prompts, a1's flags
#   call:   JAXLLM_COMMIT=<commit> BUDGET=560 bash benchmarks/h200_profile.sh start &&
#           bash benchmarks/h200_profile.sh wait 560
HERE=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=benchmarks/h200_serving.sh
source "$HERE/h200_serving.sh"   # offline
A1="--max-num-seqs 1024 --max-num-batched-tokens 8192 --num-gpu-blocks-override 48000 --unroll-layers"
ONE="--model llama-3-8b --load-format dummy --dtype bfloat16 --no-progress --dataset-name random
  --input-len 1024 --output-len 160 --num-prompts 2 --max-num-seqs 1 --max-num-batched-tokens 2048
  --num-gpu-blocks-override 2000 --unroll-layers --trace-steps 60:40 --host-profile-steps 110:40 --top 40"

steps() {
  # shellcheck disable=SC2086
  step p1_profile_awq_b1 60 150 $PY -m jaxllm.benchmarks.step_profile $ONE --quantization awq \
    --out-dir "$DIR/p1" --output-json "$DIR/p1_profile_awq_b1.json"
  # shellcheck disable=SC2086
  step p2_profile_bf16_b1 60 150 $PY -m jaxllm.benchmarks.step_profile $ONE \
    --out-dir "$DIR/p2" --output-json "$DIR/p2_profile_bf16_b1.json"
  rm -rf "$DIR"/p1/trace "$DIR"/p2/trace
  # shellcheck disable=SC2086
  step t1_step_timeline 150 260 $PY -m jaxllm.benchmarks.step_timeline --model llama-3-8b \
    --load-format dummy --dtype bfloat16 --no-progress --dataset-name sharegpt-like \
    --num-prompts 1000 $A1 --output-json "$DIR/t1_step_timeline.json"
  MODEL=llama-3-8b ENGINE="$A1 --quantization awq" offline a5_offline_8b_awq 150 260
  return 0
}

summary() {
  $PY -m jaxllm.benchmarks.chain_summary "$DIR" 2>/dev/null
  grep -h -A 14 "busy\|kernel" "$DIR"/p*.log 2>/dev/null | cut -c1-160 | head -80
  grep -A 16 "^bin " "$DIR"/t1*.log 2>/dev/null | cut -c1-160
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
