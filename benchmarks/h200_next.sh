#!/usr/bin/env bash
# Issue 16's H200 points not yet measured (chain for benchmarks/gpu_chain.sh, one GPU):
#   v1/v2  decode step over FP8 pages, then bf16 pages (the decode kernel's V widened before
#          it is staged: counted in SASS, not timed yet; compare with h200_verify.sh's v2/v3)
#   w1-w5  warm restart to ready, cold and warm (a fresh process each over one new cache
#          directory), Llama-3-8B shape, from dummy weights, from a local HF safetensors
#          checkpoint (benchmarks/write_checkpoint.py) and from its orbax conversion
#   x1     Llama-3-70B shape with AWQ int4 (dummy, group 128) on ONE H200: decode step at
#          batch 1 and 64, context 1024, against the roofline (waited and back to back)
#   x2     the same model offline, sharegpt-like, 1000 prompts
#   x3     the same model served at rate inf and 10 req/s (300 prompts)
# 70B steps use 256 sequences / 2048 tokens a step (fewer buckets to compile for 80 layers).
#   call 1:   JAXLLM_COMMIT=<commit> BUDGET=1150 bash benchmarks/h200_next.sh start &&
#             bash benchmarks/h200_next.sh wait 580
#   call 2:   bash benchmarks/h200_next.sh wait 580
HERE=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=benchmarks/h200_serving.sh
source "$HERE/h200_serving.sh"   # offline, served
HF=/tmp/llama-3-8b-hf; ORBAX=/tmp/llama-3-8b-hf-orbax
RESTART="-m jaxllm.benchmarks.warm_restart --starts cold,warm --max-num-seqs 256 --max-num-batched-tokens 2048"
BIG="--max-num-seqs 256 --max-num-batched-tokens 2048 --num-gpu-blocks-override 12000 --unroll-layers --quantization awq"

steps() {
  # shellcheck disable=SC2086
  {
    step v1_latency_fp8kv 30 60 $PY -m jaxllm.benchmarks latency --model llama-3-8b \
      --load-format dummy --dtype bfloat16 --context-len 1024 --unroll-layers --iters 20 \
      --no-progress --batch-sizes 1,64,256 --kv-cache-dtype fp8 --output-json "$DIR/v1_fp8kv.json"
    step v2_latency_bf16 30 60 $PY -m jaxllm.benchmarks latency --model llama-3-8b \
      --load-format dummy --dtype bfloat16 --context-len 1024 --unroll-layers --iters 20 \
      --no-progress --batch-sizes 1,64,256 --output-json "$DIR/v2_bf16.json"
    step w1_restart_dummy 60 200 $PY $RESTART --model llama-3-8b --load-format dummy \
      --output-json "$DIR/w1_restart_dummy.json"
    rm -rf "$HF" "$ORBAX"
    step w2_write_hf 60 200 $PY -m jaxllm.benchmarks.write_checkpoint llama-3-8b "$HF"
    step w3_restart_hf 60 240 $PY $RESTART --model "$HF" --output-json "$DIR/w3_restart_hf.json"
    step w4_convert 60 200 $PY -m jaxllm convert "$HF" "$ORBAX" --unroll-layers
    step w5_restart_orbax 60 200 $PY $RESTART --model "$ORBAX" \
      --output-json "$DIR/w5_restart_orbax.json"
    rm -rf "$HF" "$ORBAX"
    step x1_latency_70b_awq 90 200 $PY -m jaxllm.benchmarks latency --model llama-3-70b \
      --load-format dummy --dtype bfloat16 --quantization awq --batch-sizes 1,64 \
      --context-len 1024 --unroll-layers --iters 20 --no-progress \
      --output-json "$DIR/x1_latency_70b_awq.json"
    MODEL=llama-3-70b ENGINE=$BIG offline x2_offline_70b_awq 200 420
    export -f served
    step x3_served_70b_awq 200 420 bash -c "DIR=$DIR PY=$PY MODEL=llama-3-70b DTYPE=$DTYPE \
      N=$N ENGINE='$BIG' SERVE_FLAGS=''; served x3 inf,10"
  }
  return 0
}

summary() {
  $PY -m jaxllm.benchmarks.chain_summary "$DIR" 2>/dev/null
  grep -h "ready\|wrote\|^ batch\|^ *[0-9]\+ \+[0-9.]\+ " "$DIR"/v*.log "$DIR"/w*.log "$DIR"/x1*.log \
    2>/dev/null | cut -c1-200
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
