#!/usr/bin/env bash
# One H200 (chain for benchmarks/gpu_chain.sh): the prefill kernel's new default, what a
# Hopper-native attention kernel reaches, the served 10 req/s tail with the collector watched,
# and Llama-3-70B AWQ served, in order:
#   g0  the prefill/mixed kernels' GPU tests with the new default (3 stages; float32 tiles of
#       64 keys), FP8 pages, and the float32 / bf16 end-to-end greedy check through the kernels
#   k1  kernels: decode 64 x 2048 against the copy rate; prefill of 2k chunks over 0 / 2k / 8k
#       cached tokens against the matmul rate (the 12-config sweep at the first point)
#   m1  JAX's Mosaic GPU flash attention at the same shapes (contiguous K/V; evidence for a
#       Hopper prefill path)
#   s1  served through `jaxllm serve` at its defaults: rate inf (1000), then 10 req/s twice
#       (300 each); the server log carries any collection over 50 ms (gc_watch)
#   x3  Llama-3-70B AWQ int4 served on ONE H200: rate inf (300) and 2 req/s (100)
#   call 1:   JAXLLM_COMMIT=<commit> BUDGET=1150 bash benchmarks/h200_recheck.sh start &&
#             bash benchmarks/h200_recheck.sh wait 560
#   call 2:   bash benchmarks/h200_recheck.sh wait 560
HERE=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=benchmarks/h200_serving.sh
source "$HERE/h200_serving.sh"   # served
SERVE_ENGINE="--num-gpu-blocks-override 48000 --unroll-layers"
BIG="--max-num-seqs 256 --max-num-batched-tokens 2048 --unroll-layers --quantization awq"
SERVE_FLAGS="--tokenizer .gpu_deps/tokenizer_128k.json"
KERNELS="-m jaxllm.benchmarks.kernels --acceptance --dispatch-included --no-jax --no-sweep"

steps() {
  # shellcheck disable=SC2086
  {
    step g0_kernel_tests 60 170 $PY -m pytest -q -x -p no:cacheprovider -m gpu \
      tests/test_paged_attention_kernels.py tests/test_paged_attention_generation.py \
      tests/test_kv_cache_fp8.py \
      -k "long_chunks or engine_sized_step or generate_on_gpu or decode_batch or fp8"
    if [ -f "$DIR/failed" ]; then echo "kernel tests failed: chain stopped" >> "$DIR/steps.txt"; return 0; fi
    step k1_kernels 90 200 $PY $KERNELS --budget-s 120 --no-prefill-reference --out "$DIR/k1_kernels.json"
    step m1_mgpu_probe 40 150 $PY -m jaxllm.benchmarks.mgpu_attention_probe \
      --output-json "$DIR/m1_mgpu_probe.json"
    export -f served
    step s1_served_defaults 200 420 bash -c "DIR=$DIR PY=$PY MODEL=llama-3-8b DTYPE=bfloat16 \
      N=1000 N_RATED=300 ENGINE='$SERVE_ENGINE' SERVE_FLAGS='$SERVE_FLAGS'; served s1 inf,10,10"
    step x3_served_70b_awq 280 450 bash -c "DIR=$DIR PY=$PY MODEL=llama-3-70b DTYPE=bfloat16 \
      N=300 N_RATED=100 ENGINE='$BIG' SERVE_FLAGS='$SERVE_FLAGS'; served x3 inf,2"
  }
  return 0
}

summary() {
  grep -h -A 12 "^NVIDIA\|^H200\|copy .* TB/s" "$DIR"/k*.log 2>/dev/null | cut -c1-160 | head -30
  grep -h -A 4 "^chunk cached" "$DIR"/m1*.log 2>/dev/null
  grep -h "garbage collection\|compiled sampler\|server up\|server exit" "$DIR"/*.log 2>/dev/null | cut -c1-200 | head -20
  $PY -m jaxllm.benchmarks.chain_summary "$DIR" 2>/dev/null
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
