#!/usr/bin/env bash
# Issue 16's FP8 figures and issue 17's launch anatomy on one H200 (chain for
# benchmarks/gpu_chain.sh), Llama-3-8B shape, dummy weights, in one run:
#   f1     what an 8B step's launch costs the host, by what the executable holds
#   f2-f4  offline sharegpt-like, 1000 prompts, 1024 / 8192: bf16, FP8 W8A8 (compiled with
#          autotune level 1), bf16 weights with an FP8 KV cache
#   call 1:   JAXLLM_COMMIT=<commit> bash benchmarks/h200_fp8.sh start &&
#             bash benchmarks/h200_fp8.sh wait 560
#   call 2+:  bash benchmarks/h200_fp8.sh wait 560
HERE=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=benchmarks/h200_structured.sh
source "$HERE/h200_structured.sh"   # throughput
ENGINE="--max-num-seqs 1024 --max-num-batched-tokens 8192 --num-gpu-blocks-override 48000 --unroll-layers"
SHAREGPT="--dataset-name sharegpt-like --num-prompts $N"

steps() {
  # shellcheck disable=SC2086
  {
    step f1_launch_anatomy 120 200 $PY -m jaxllm.benchmarks.launch_anatomy --buckets 1x1,64x1 \
      --output-json "$DIR/f1_launch_anatomy.json"
    throughput f2_sharegpt_bf16 150 240 $SHAREGPT
    throughput f3_sharegpt_fp8 200 420 $SHAREGPT --quantization fp8
    throughput f4_sharegpt_fp8kv 120 240 $SHAREGPT --kv-cache-dtype fp8
  }
  return 0
}

summary() { $PY -m jaxllm.benchmarks.chain_summary "$DIR"; }

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
