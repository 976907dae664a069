#!/usr/bin/env bash
# One H200 (chain for benchmarks/gpu_chain.sh): the Mosaic GPU prefill kernel's first run.
#   h0  its GPU tests against the reference (a barrier mistake would hang: the limit ends it)
#       and greedy generation through backend pallas_mosaic (the chain stops if any fails);
#       H0_K=<pytest -k expression> runs a subset
#   h1  kernels: 2k chunks over 0 / 2k / 8k cached tokens, the Triton default and the Hopper
#       kernel side by side against the matmul rate (decode's acceptance point too)
#   h2  offline sharegpt-like, 1000 prompts, 1024 / 8192, every step against its floor, with
#       --attention-backend pallas_mosaic; h3 the same with pallas (Triton prefill), same run
#   call 1:  JAXLLM_COMMIT=<commit> BUDGET=900 bash benchmarks/h200_hopper.sh start &&
#            bash benchmarks/h200_hopper.sh wait 500
#   call 2:  bash benchmarks/h200_hopper.sh wait 420
HERE=$(dirname "${BASH_SOURCE[0]}")
TIMELINE="-m jaxllm.benchmarks.step_timeline --model llama-3-8b --load-format dummy
  --dtype bfloat16 --no-progress --num-prompts 1000 --max-num-seqs 1024
  --max-num-batched-tokens 8192 --num-gpu-blocks-override 48000 --unroll-layers
  --dataset-name sharegpt-like"

steps() {
  # shellcheck disable=SC2086
  {
    step h0_hopper_tests 60 240 $PY -m pytest -q -x -p no:cacheprovider -m gpu \
      tests/test_prefill_hopper.py tests/test_paged_attention_generation.py -k "${H0_K:-Hopper or hopper}"
    step h1_kernels_hopper 60 280 $PY -m jaxllm.benchmarks.kernels --acceptance \
      --dispatch-included --no-jax --no-sweep --no-prefill-sweep --no-prefill-reference --hopper \
      --budget-s 100 --out "$DIR/h1_kernels_hopper.json"
    if [ -f "$DIR/failed" ]; then echo "a step failed: chain stopped" >> "$DIR/steps.txt"; return 0; fi
    step h2_sharegpt_mosaic 130 260 $PY $TIMELINE --attention-backend pallas_mosaic \
      --output-json "$DIR/h2_sharegpt_mosaic.json"
    step h3_sharegpt_triton 130 260 $PY $TIMELINE --attention-backend pallas \
      --output-json "$DIR/h3_sharegpt_triton.json"
  }
  return 0
}

summary() {
  grep -h "passed\|failed\|error" "$DIR"/h0*.log 2>/dev/null | tail -3
  grep -h -A 12 "^NVIDIA\|^H200\|copy .* TB/s" "$DIR"/h1*.log 2>/dev/null | cut -c1-160 | head -20
  grep -h -i "output tok/s\|of floor" "$DIR"/h[23]*.log 2>/dev/null | head -12
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
