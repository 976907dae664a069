#!/usr/bin/env bash
# Issue 16's points left after h200_next.sh (chain for benchmarks/gpu_chain.sh, one GPU):
#   x2  Llama-3-70B shape, AWQ int4 (dummy, group 128), ONE H200, offline sharegpt-like, 1000
#       prompts (h200_next's x2 ran out of memory before 943e1c5: XLA kept every layer's
#       dequantized weights live); no --num-gpu-blocks-override: the engine sizes the pool
#       and its log gives the activation peak
#   x3  the same model served at rate inf (300 prompts) and 10 req/s (100 prompts)
#   a5  Llama-3-8B shape, AWQ int4, offline sharegpt-like, 1000 prompts, h200_session's a1
#       flags (bf16 gave 11,011 output tok/s there)
# (The HF load time and the step timeline: h200_tail.sh.)
#   call 1:   JAXLLM_COMMIT=<commit> BUDGET=640 bash benchmarks/h200_last.sh start &&
#             bash benchmarks/h200_last.sh wait 560
#   call 2:   bash benchmarks/h200_last.sh wait 100
HERE=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=benchmarks/h200_serving.sh
source "$HERE/h200_serving.sh"   # offline, served
BIG="--max-num-seqs 256 --max-num-batched-tokens 2048 --unroll-layers --quantization awq"
A1="--max-num-seqs 1024 --max-num-batched-tokens 8192 --num-gpu-blocks-override 48000 --unroll-layers"

steps() {
  MODEL=llama-3-70b ENGINE=$BIG offline x2_offline_70b_awq 240 400
  export -f served
  # shellcheck disable=SC2086
  step x3_served_70b_awq 120 240 bash -c "DIR=$DIR PY=$PY MODEL=llama-3-70b DTYPE=$DTYPE \
    N=300 N_RATED=100 ENGINE='$BIG' SERVE_FLAGS=''; served x3 inf,10"
  MODEL=llama-3-8b ENGINE="$A1 --quantization awq" offline a5_offline_8b_awq 120 240
  return 0
}

summary() {
  $PY -m jaxllm.benchmarks.chain_summary "$DIR" 2>/dev/null
  grep -h "activation peak\|engine ready" "$DIR"/x2*.log "$DIR"/x3_server.log 2>/dev/null \
    | cut -c1-400
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
