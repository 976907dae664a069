#!/usr/bin/env bash
# What a short device call could still check after h200_next.sh (chain for
# benchmarks/gpu_chain.sh, one GPU), in order:
#   g1  the int4 GEMV's denormal loop (de6139c, its default now: SASS only so far) against the
#       loop before, Llama-3-8B projections at one token, each checked against the reference
#   g2  the 8B AWQ decode step at batch 1 with it (4.19 ms back to back before, 86ef6d8)
#   f1  the Llama-3-70B AWQ forward's temporaries at 2,048 tokens, with the full, no and small
#       dequantization barrier (943e1c5; small: scales and zeros only), compiled, not run
#   l1  load_model from a local HF safetensors checkpoint of the 8B shape (ab302b5) against
#       its orbax conversion
#   t1  the whole offline run's steps by size against their cost floors (bf16, a1's flags)
#   call:   JAXLLM_COMMIT=<commit> BUDGET=290 bash benchmarks/h200_tail.sh start &&
#           bash benchmarks/h200_tail.sh wait 285
HERE=$(dirname "${BASH_SOURCE[0]}")
HF=/tmp/llama-3-8b-hf
A1="--max-num-seqs 1024 --max-num-batched-tokens 8192 --num-gpu-blocks-override 48000 --unroll-layers"
export PYTHONPATH=.:.gpu_deps

steps() {
  step g1_gemv_denormal 30 90 $PY -m jaxllm.benchmarks.int4_matmul --models 8b --tokens 1 \
    --gemv-before --output-json "$DIR/g1_gemv.json"
  step g2_latency_awq 30 80 $PY -m jaxllm.benchmarks latency --model llama-3-8b \
    --load-format dummy --dtype bfloat16 --quantization awq --batch-sizes 1 \
    --context-len 1024 --unroll-layers --iters 20 --no-progress \
    --output-json "$DIR/g2_latency_awq.json"
  step f1_forward_temps_70b_awq 60 130 $PY -m jaxllm.benchmarks.forward_temps \
    --model llama-3-70b --quantization awq --tokens 2048 --barriers full,none,small \
    --output-json "$DIR/f1_forward_temps.json"
  rm -rf "$HF"
  step l0_write_hf 20 60 $PY -m jaxllm.benchmarks.write_checkpoint llama-3-8b "$HF"
  step l1_load_time 60 150 $PY -m jaxllm.benchmarks.load_time "$HF" --formats hf,orbax \
    --dtype bfloat16 --output-json "$DIR/l1_load_time.json"
  rm -rf "$HF"
  # shellcheck disable=SC2086
  step t1_step_timeline 120 240 $PY -m jaxllm.benchmarks.step_timeline --model llama-3-8b \
    --load-format dummy --dtype bfloat16 --no-progress --dataset-name sharegpt-like \
    --num-prompts 1000 $A1 --output-json "$DIR/t1_step_timeline.json"
  return 0
}

summary() {
  grep -h "gemv\|BAD\|^ *[0-9]\+ \+[0-9.]\+ \|b2b" "$DIR"/g*.log 2>/dev/null | cut -c1-200
  grep -h "tokens  temporaries\|loaded in" "$DIR"/f1*.log 2>/dev/null
  tail -n 8 "$DIR"/l1*.log 2>/dev/null
  grep -A 16 "^bin " "$DIR"/t1*.log 2>/dev/null | cut -c1-160
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
