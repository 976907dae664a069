#!/usr/bin/env bash
# The session's last H200 call (chain for benchmarks/gpu_chain.sh), in priority order (g1,
# the pair of g2, last: h200_fp8.sh's f1 measured it before):
#   g0     the jaxllm import's XLA_FLAGS on the GPU machine, and the devices
#   g1/g2  an 8B decode step's launch without / with Pallas' Triton calls in XLA's command
#          buffers (JAXLLM_XLA_DEFAULTS=0 / jaxllm's default), one process each
#   g3     the compiled kernels over FP8 KV pages against the reference (GPU tests)
#   g4     the engine's host path per step at 1,024 running sequences (tiny model, this host)
#   g5     offline sharegpt-like, 1000 prompts, Llama-3-8B, 1024 / 8192 (as f2 of h200_fp8.sh)
#   JAXLLM_COMMIT=<commit> BUDGET=300 bash benchmarks/h200_final.sh start &&
#   bash benchmarks/h200_final.sh wait 540
HERE=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=benchmarks/h200_structured.sh
source "$HERE/h200_structured.sh"   # throughput
ENGINE="--max-num-seqs 1024 --max-num-batched-tokens 8192 --num-gpu-blocks-override 48000 --unroll-layers"
ANATOMY="-m jaxllm.benchmarks.launch_anatomy --variants unrolled --buckets 1x1,64x1 --iters 30"

steps() {
  # shellcheck disable=SC2086
  {
    step g0_flags 10 30 $PY -c 'import os, jaxllm, jax; print(os.environ.get("XLA_FLAGS"), jax.devices())'
    [ -f "$DIR/failed" ] && export JAXLLM_XLA_DEFAULTS=0  # the GPU jaxlib refused the flag
    step g2_launch_default_on 40 80 $PY $ANATOMY --output-json "$DIR/g2_launch_default_on.json"
    step g3_fp8_pages 30 90 $PY -m pytest tests/test_kv_cache_fp8.py -k gpu -p no:cacheprovider \
      -W ignore::DeprecationWarning -rA
    step g4_host_step 25 60 $PY -m jaxllm.benchmarks.host_step --num-seqs 1024 \
      --prefix-caching off on --output-json "$DIR/g4_host_step.json"
    throughput g5_sharegpt_1024 140 200 --dataset-name sharegpt-like --num-prompts "$N"
    step g1_launch_default_off 40 80 env JAXLLM_XLA_DEFAULTS=0 $PY $ANATOMY \
      --output-json "$DIR/g1_launch_default_off.json"
  }
  return 0
}

summary() { $PY -m jaxllm.benchmarks.chain_summary "$DIR" 2>/dev/null; }

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
