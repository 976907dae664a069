#!/usr/bin/env bash
# Issues 16 and 17 in one run on one H200 (chain for benchmarks/gpu_chain.sh), Llama-3-8B shape,
# dummy weights, 1024 sequences / 8192 tokens a step (the server's default on this GPU, given
# explicitly offline where `bench throughput` would take 16384), 48000 KV blocks:
#   a1  offline sharegpt-like, 1000 prompts, bf16
#   s1  served through `jaxllm serve` with no limit flags (its defaults) at rate inf and at
#       10 req/s (300 prompts), with a tokenizer so that every sampled id decodes to text
#   a2  offline, FP8 W8A8;  a3  FP8 W8A8 + FP8 KV cache;  a4  bf16 + FP8 KV cache
#   l1-l4  decode step at batch 1 / 64 / 256, context 1024, waited and back to back:
#       bf16, FP8 W8A8, bf16 + FP8 KV, AWQ int4
#   r1  offline random 512 in / 128 out, 1000 prompts, bf16
#   g1  the int4 GEMV's block configs at one token, 8B projections (GEMV_TABLE's lines)
#   call 1:   JAXLLM_COMMIT=<commit> BUDGET=1180 bash benchmarks/h200_session.sh start &&
#             bash benchmarks/h200_session.sh wait 585
#   call 2:   bash benchmarks/h200_session.sh wait 590
HERE=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=benchmarks/h200_serving.sh
source "$HERE/h200_serving.sh"   # offline, served
ENGINE="--max-num-seqs 1024 --max-num-batched-tokens 8192 --num-gpu-blocks-override 48000 --unroll-layers"
SERVE_ENGINE="--num-gpu-blocks-override 48000 --unroll-layers"
SERVE_FLAGS="--tokenizer .gpu_deps/tokenizer_128k.json"
LATENCY="-m jaxllm.benchmarks latency --model $MODEL --load-format dummy --dtype $DTYPE
  --batch-sizes 1,64,256 --context-len 1024 --unroll-layers --iters 20 --no-progress"

steps() {
  # shellcheck disable=SC2086
  {
    offline a1_bf16 150 240
    export -f served
    step s1_served_defaults 120 240 bash -c "DIR=$DIR PY=$PY MODEL=$MODEL DTYPE=$DTYPE N=$N \
      ENGINE='$SERVE_ENGINE' SERVE_FLAGS='$SERVE_FLAGS'; served s1 inf,10"
    offline a2_fp8 160 260 --quantization fp8
    offline a3_fp8_fp8kv 160 260 --quantization fp8 --kv-cache-dtype fp8
    step l1_latency_bf16 45 90 $PY $LATENCY --output-json "$DIR/l1_latency_bf16.json"
    step l2_latency_fp8 50 100 $PY $LATENCY --quantization fp8 --output-json "$DIR/l2_latency_fp8.json"
    step l3_latency_fp8kv 45 90 $PY $LATENCY --kv-cache-dtype fp8 --output-json "$DIR/l3_latency_fp8kv.json"
    step l4_latency_awq 50 100 $PY $LATENCY --quantization awq --output-json "$DIR/l4_latency_awq.json"
    offline a4_bf16_fp8kv 140 240 --kv-cache-dtype fp8
    offline r1_random 150 240 --dataset-name random --input-len 512 --output-len 128
    step g1_gemv_sweep 60 150 $PY -m jaxllm.benchmarks.int4_matmul --models 8b --tokens 1 \
      --gemv-sweep --output-json "$DIR/g1_gemv_sweep.json"
  }
  return 0
}

summary() {
  $PY -m jaxllm.benchmarks.chain_summary "$DIR" 2>/dev/null
  grep -h "^\[jaxllm\]\|engine ready\|max_num_seqs [0-9]" "$DIR"/*.log 2>/dev/null | cut -c1-260
  for f in "$DIR"/l*_latency_*.log; do [ -f "$f" ] && { echo "-- $f"; grep -A4 "^ batch" "$f"; }; done
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
