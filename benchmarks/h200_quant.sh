#!/usr/bin/env bash
# Issue 16's first H200 figures (chain for benchmarks/gpu_chain.sh, one GPU): the Llama-3-8B
# shape, dummy weights, bf16 against the load-time quantizations (int8 weight-only, fp8 W8A8),
# in one run: the decode step at batch 1 / 64 / 256 (context 1024) against the weight + KV
# roofline, then offline sharegpt-like 1000 prompts for bf16 and fp8 with the engine flags of
# the earlier headline runs.
#   call 1:   JAXLLM_COMMIT=<commit> bash benchmarks/h200_quant.sh start &&
#             bash benchmarks/h200_quant.sh wait 540
#   call 2+:  bash benchmarks/h200_quant.sh wait 560
PY=${PY:-python3}
MODEL=${MODEL:-llama-3-8b}
ENGINE=${ENGINE:---max-num-seqs 256 --max-num-batched-tokens 2048 --num-gpu-blocks-override 48000 --unroll-layers}

latency() {  # latency NAME QUANT_FLAGS...
  local name=$1; shift
  step "$name" 90 300 $PY -m jaxllm.benchmarks latency --model "$MODEL" --load-format dummy \
    --dtype bfloat16 --batch-sizes 1,64,256 --context-len 1024 --unroll-layers "$@" \
    --output-json "$DIR/$name.json"
}

throughput() {  # throughput NAME QUANT_FLAGS...
  local name=$1; shift
  # shellcheck disable=SC2086  # word splitting of the engine flags is intended
  step "$name" 150 420 $PY -m jaxllm.benchmarks throughput --model "$MODEL" --load-format dummy \
    --dtype bfloat16 --no-progress --dataset-name sharegpt-like --num-prompts 1000 \
    --backend jaxllm $ENGINE "$@" --output-json "$DIR/$name.json"
}

steps() {
  latency q1_latency_bf16
  latency q2_latency_int8 --quantization int8
  latency q3_latency_fp8 --quantization fp8
  throughput q4_sharegpt_bf16
  throughput q5_sharegpt_fp8 --quantization fp8
}

summary() {
  grep -h -B1 -A3 "^ *batch *step ms" "$DIR"/q*_latency_*.log 2>/dev/null
  grep -h "Throughput:\|steps, " "$DIR"/q*_sharegpt_*.log 2>/dev/null
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$(dirname "$0")/gpu_chain.sh" "$0" "$@"
fi
