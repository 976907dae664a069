#!/usr/bin/env bash
# One H200 (chain for benchmarks/gpu_chain.sh): the AWQ forward's kernel count against its
# batch-1 launch, and the tiled int4 kernel with one dot a step, in order:
#   p1  8B AWQ, batch 1, traced, the default GEMV (x pre-scaled in XLA, split sums in XLA)
#   p5  the same with the split sums in the kernel (splits_sum=last: 64 fewer kernels a step)
#   p6  the same with x read by the kernel (x_in_kernel: 96 fewer)
#   p7  both
#   i2  the tiled int4 kernel, default and one_dot, against XLA's dequantize + dot and bf16 at
#       128 / 512 / 2048 tokens (qkv, o, gate_up, down of the 8B shape)
#   m2  JAX's Mosaic GPU attention probe again (float16), now checked against its reference
#   JAXLLM_COMMIT=<commit> BUDGET=760 bash benchmarks/h200_gemv_modes.sh start &&
#     bash benchmarks/h200_gemv_modes.sh wait 560;  bash benchmarks/h200_gemv_modes.sh wait 300
HERE=$(dirname "${BASH_SOURCE[0]}")
ONE="--model llama-3-8b --load-format dummy --dtype bfloat16 --no-progress --dataset-name random
  --input-len 1024 --output-len 160 --num-prompts 2 --max-num-seqs 1 --max-num-batched-tokens 2048
  --num-gpu-blocks-override 2000 --unroll-layers --trace-steps 60:40 --host-profile-steps 110:40
  --top 40 --quantization awq"

steps() {
  # shellcheck disable=SC2086
  {
    step p1_awq_default 70 130 $PY -m jaxllm.benchmarks.step_profile $ONE --out-dir "$DIR/p1"
    step p5_awq_splits_last 70 130 $PY -m jaxllm.benchmarks.step_profile $ONE \
      --gemv-overrides splits_sum=last --out-dir "$DIR/p5"
    step p6_awq_x_in_kernel 70 130 $PY -m jaxllm.benchmarks.step_profile $ONE \
      --gemv-overrides x_in_kernel=True --out-dir "$DIR/p6"
    step p7_awq_both 70 130 $PY -m jaxllm.benchmarks.step_profile $ONE \
      --gemv-overrides splits_sum=last,x_in_kernel=True --out-dir "$DIR/p7"
    rm -rf "$DIR"/p*/trace
    step i2_int4_tiled 90 200 $PY -m jaxllm.benchmarks.int4_matmul --models 8b \
      --tokens 128,512,2048 --with-xla --one-dot --copies 8 --output-json "$DIR/i2_int4_tiled.json"
    step m2_mgpu_probe 40 150 $PY -m jaxllm.benchmarks.mgpu_attention_probe --dtype float16 \
      --output-json "$DIR/m2_mgpu_probe.json"
  }
  return 0
}

summary() {
  for log in "$DIR"/p*.log; do
    echo "${log##*/}"; grep -h "pass 1\|traced" "$log" 2>/dev/null | cut -c1-250
  done
  grep -h -A 40 "^model shape" "$DIR"/i2*.log 2>/dev/null | head -40
  grep -h -A 4 "^chunk cached" "$DIR"/m2*.log 2>/dev/null
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
