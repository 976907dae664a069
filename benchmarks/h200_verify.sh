#!/usr/bin/env bash
# The session's last H200 call (chain for benchmarks/gpu_chain.sh): FP8 KV pages widened to
# float16 (not bfloat16) in the attention kernels, and the tuned GEMV_TABLE, Llama-3-8B shape:
#   v1  the compiled kernels over FP8 pages against the reference (GPU tests)
#   v2  decode step over FP8 pages, v3 over bf16 pages (b2b: as h200_session.sh's l1/l3)
#   v4  AWQ decode step at batch 1 and 64 with the tuned GEMV configs (as l4)
#   JAXLLM_COMMIT=<commit> BUDGET=250 bash benchmarks/h200_verify.sh start &&
#   bash benchmarks/h200_verify.sh wait 250
HERE=$(dirname "${BASH_SOURCE[0]}")
LATENCY="-m jaxllm.benchmarks latency --model llama-3-8b --load-format dummy --dtype bfloat16
  --context-len 1024 --unroll-layers --iters 20 --no-progress"

steps() {
  # shellcheck disable=SC2086
  {
    step v1_fp8_pages 30 60 $PY -m pytest tests/test_kv_cache_fp8.py -k gpu -p no:cacheprovider \
      -W ignore::DeprecationWarning -rA
    step v2_latency_fp8kv 30 60 $PY $LATENCY --batch-sizes 1,64,256 --kv-cache-dtype fp8 \
      --output-json "$DIR/v2_latency_fp8kv.json"
    step v3_latency_bf16 30 60 $PY $LATENCY --batch-sizes 1,64,256 \
      --output-json "$DIR/v3_latency_bf16.json"
    step v4_latency_awq 30 60 $PY $LATENCY --batch-sizes 1,64 --quantization awq \
      --output-json "$DIR/v4_latency_awq.json"
  }
  return 0
}

summary() {
  for f in "$DIR"/v*_latency_*.log; do [ -f "$f" ] && { echo "-- $f"; grep -A4 "^ batch" "$f"; }; done
  grep -h "passed\|failed" "$DIR"/v1_fp8_pages.log 2>/dev/null | tail -2
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
