#!/usr/bin/env bash
# Issue 17's default limits and bucket ladder on one H200 (chain for benchmarks/gpu_chain.sh),
# Llama-3-8B shape, dummy bf16, sharegpt-like, 1000 prompts:
#   d1  offline with no limit flags: the LLM class's defaults on a >= 70 GiB GPU (1024
#       sequences, 16384 tokens a step), the KV pool sized from memory as a user gets it
#   d2  offline at the old headline limits (256 / 2048, 48000 KV blocks), same run
#   d3  served through `jaxllm serve` with no limit flags (the server's 1024 / 8192) at rate
#       inf and at 10 req/s (300 prompts; goals: P99 TTFT <= 100 ms, median TPOT <= 8 ms)
#   d4  offline with no limit flags again (brackets the machine's drift with d1)
# The offline JSONs hold the resolved limits (engine_config) and warm_up_s; the server's log
# has the engine's "max_num_seqs ..., max_num_batched_tokens ..." line (the limits and where
# they came from) and "engine ready ... (N step buckets, M programs ...)" (warm-up).
#   call 1:   JAXLLM_COMMIT=<commit> bash benchmarks/h200_defaults.sh start &&
#             bash benchmarks/h200_defaults.sh wait 540
#   call 2+:  bash benchmarks/h200_defaults.sh wait 560
# Needs pyzmq in .gpu_deps/ for d3 (carried, as benchmarks/h200_serving.sh says).
HERE=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=benchmarks/h200_serving.sh
source "$HERE/h200_serving.sh"   # offline, served
OLD="--max-num-seqs 256 --max-num-batched-tokens 2048 --num-gpu-blocks-override 48000 --unroll-layers"
DEFAULTS="--unroll-layers"   # non-empty: an empty ENGINE would take h200_serving.sh's default

steps() {
  ENGINE=$DEFAULTS offline d1_offline_defaults 200 360
  ENGINE=$OLD offline d2_offline_256 150 300
  export -f served
  step d3_served_defaults 240 480 bash -c "DIR=$DIR PY=$PY MODEL=$MODEL DTYPE=$DTYPE \
    N=$N ENGINE='$DEFAULTS' SERVE_FLAGS='$SERVE_FLAGS'; served d3_core inf,10"
  ENGINE=$DEFAULTS offline d4_offline_defaults 150 300
  return 0
}

summary() {
  $PY -m jaxllm.benchmarks.chain_summary "$DIR"
  grep -h "max_num_seqs [0-9]\|engine ready" "$DIR"/*.log 2>/dev/null | cut -c1-300
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
