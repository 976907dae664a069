#!/usr/bin/env bash
# Issue 17's larger steps and issue 16's FP8 compile time on one H200 (chain for
# benchmarks/gpu_chain.sh), Llama-3-8B shape, dummy bf16, 1000 prompts each:
#   b1     offline sharegpt-like at the headline limits (256 sequences, 2048 tokens a step)
#   b2     the same at 1024 / 8192 under step_profile (pass 1 timed as b1; pass 2 traced)
#   b3     offline sharegpt-like at 512 / 4096
#   b4/b5  offline random 512/128 at 1024 / 8192 and at the headline limits
#   b6     FP8 forward compile seconds per bucket under XLA's autotune levels 0 and 1
#   call 1:   JAXLLM_COMMIT=<commit> bash benchmarks/h200_bigsteps.sh start &&
#             bash benchmarks/h200_bigsteps.sh wait 540
HERE=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=benchmarks/h200_structured.sh
source "$HERE/h200_structured.sh"   # throughput
HEADLINE=$ENGINE
BIG="--max-num-seqs 1024 --max-num-batched-tokens 8192 --num-gpu-blocks-override 48000 --unroll-layers"
MID="--max-num-seqs 512 --max-num-batched-tokens 4096 --num-gpu-blocks-override 48000 --unroll-layers"
SHAREGPT="--dataset-name sharegpt-like --num-prompts $N"

steps() {
  # shellcheck disable=SC2086
  {
    ENGINE=$HEADLINE throughput b1_sharegpt_256 150 240 $SHAREGPT
    step b2_profile_1024 200 330 $PY -m jaxllm.benchmarks.step_profile --model "$MODEL" \
      --load-format dummy --dtype "$DTYPE" --no-progress $BIG $SHAREGPT \
      --trace-steps 40:40 --host-profile-steps 150:60 --out-dir "$DIR/b2_profile" \
      --output-json "$DIR/b2_profile_1024.json"
    ENGINE=$MID throughput b3_sharegpt_512 100 200 $SHAREGPT
    ENGINE=$BIG throughput b4_random_1024 100 200 $RANDOM_WL --num-prompts "$N"
    ENGINE=$HEADLINE throughput b5_random_256 90 200 $RANDOM_WL --num-prompts "$N"
    step b6_fp8_compile 60 200 $PY -m jaxllm.benchmarks.fp8_compile_time --variants \
      level0,level1 --buckets 256x1,8x256 --timeout 90 --output-json "$DIR/b6_fp8_compile.json"
  }
  return 0
}

summary() { $PY -m jaxllm.benchmarks.chain_summary "$DIR"; }

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
