#!/usr/bin/env bash
# GPU check of the Pallas paged-attention kernels. Two parts, each fits one 10-minute call:
#   tests  the GPU kernel test classes + the end-to-end greedy check (pytest -m gpu, ~5 min)
#   bench  benchmarks/kernels.py: ceilings, decode sweep, decode grid against the reference and
#          JAX's own kernel, prefill (~5 min); extra arguments go to kernels.py
# Usage, from the repo root on the GPU machine:
#   OUT=/some/dir bash benchmarks/gpu_check.sh tests|bench|all [kernels.py args]
# Logs and JSON land in $OUT; the last lines printed are the summary / benchmark table.
set -o pipefail
MODE=${1:-all}
shift || true
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
PY=${PYTHON:-python3}

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem \
    --format=csv
  $PY -c 'import jax, jaxlib, flax; print("jax", jax.__version__, "jaxlib", jaxlib.__version__,
          "flax", flax.__version__, jax.devices())'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [[ $MODE == tests || $MODE == all ]]; then
  start=$(date +%s)
  timeout "${TEST_TIMEOUT:-540}" $PY -m pytest tests/test_paged_attention_kernels.py \
    tests/test_paged_attention_generation.py -m gpu \
    -p no:cacheprovider -W ignore::DeprecationWarning -rA -s 2>&1 > "$OUT/pytest_gpu.log"
  echo "pytest rc=$? in $(( $(date +%s) - start )) s"
  grep -E "passed|failed|PASSED|FAILED|Error|of tokens equal" "$OUT/pytest_gpu.log" | tail -25
fi

if [[ $MODE == bench || $MODE == all ]]; then
  start=$(date +%s)
  timeout "${BENCH_TIMEOUT:-540}" $PY benchmarks/kernels.py --out "$OUT/kernels.json" \
    --budget-s $(( ${BENCH_TIMEOUT:-540} - 120 )) "$@" > "$OUT/bench.log" 2>&1
  rc=$?
  grep -v "^  sweep\|^  prefill\|^decode {" "$OUT/bench.log" | tail -45
  echo "bench rc=$rc in $(( $(date +%s) - start )) s"
fi
