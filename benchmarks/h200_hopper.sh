#!/usr/bin/env bash
# One H200 (chain for benchmarks/gpu_chain.sh): the Mosaic GPU prefill kernel's first run.
#   h0  its GPU tests against the reference (a barrier mistake would hang: the limit ends it)
#   h1  kernels: 2k chunks over 0 / 2k / 8k cached tokens, the Triton default and the Hopper
#       kernel side by side against the matmul rate (decode's acceptance point too)
#   JAXLLM_COMMIT=<commit> BUDGET=330 bash benchmarks/h200_hopper.sh start &&
#     bash benchmarks/h200_hopper.sh wait 340
HERE=$(dirname "${BASH_SOURCE[0]}")

steps() {
  # shellcheck disable=SC2086
  {
    step h0_hopper_tests 60 180 $PY -m pytest -q -x -p no:cacheprovider -m gpu \
      tests/test_prefill_hopper.py
    step h1_kernels_hopper 60 150 $PY -m jaxllm.benchmarks.kernels --acceptance \
      --dispatch-included --no-jax --no-sweep --no-prefill-sweep --no-prefill-reference --hopper \
      --budget-s 100 --out "$DIR/h1_kernels_hopper.json"
  }
  return 0
}

summary() {
  grep -h "passed\|failed\|error" "$DIR"/h0*.log 2>/dev/null | tail -3
  grep -h -A 12 "^NVIDIA\|^H200\|copy .* TB/s" "$DIR"/h1*.log 2>/dev/null | cut -c1-160 | head -20
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
