#!/usr/bin/env bash
# XLA's programmatic dependent launch (PDL) on a Hopper GPU (chain for benchmarks/gpu_chain.sh).
# With --xla_gpu_enable_pdl every kernel XLA compiles, the Pallas ones included, starts with
# griddepcontrol.wait (ACQBULK in the sm_90 SASS, read on the CPU machine) and is launched so
# that it may be scheduled while the kernel before it ends; the AWQ batch-1 step is ~425
# kernels of a few microseconds, where the gaps between kernels count. In order:
#   pg  the fused int4 and RoPE kernels' GPU tests under PDL (the chain stops if they fail)
#   pt  greedy tokens of the engine (SmolLM2's shape, dummy weights, the Pallas kernels in XLA's
#       command buffers) without and with PDL: the same tokens, or PDL broke an ordering
#   pl  the decode step at 1 and 64 rows, context 1,024, back to back and by the device's time,
#       Llama-3-8B shape: bf16 and AWQ, each without and with PDL
#   pf  the same for FP8 W8A8 (when the budget holds)
#   JAXLLM_COMMIT=<commit> BUDGET=560 bash benchmarks/h200_pdl.sh start &&
#     bash benchmarks/h200_pdl.sh wait 570
HERE=$(dirname "${BASH_SOURCE[0]}")
PDL="XLA_FLAGS=--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true"
ONE_ROW="-m jaxllm.benchmarks latency --model llama-3-8b --load-format dummy --dtype bfloat16
  --batch-sizes 1,64 --context-len 1024 --unroll-layers --iters 20 --no-progress --device-time"
TOKENS="-m jaxllm.benchmarks.greedy_tokens --model smollm2-135m --unroll-layers"

steps() {
  local lat="${ONE_ROW//$'\n'/ }"  # one line (a newline in bash -c ends the command)
  # shellcheck disable=SC2086
  {
    step pg_pdl_kernel_tests 60 200 env "$PDL" $PY -m pytest -q -x -p no:cacheprovider -m gpu \
      tests/test_int4_fusion.py tests/test_rope_kv_write.py
    if ! grep -qE "^[0-9]+ passed" "$DIR"/pg_*.log 2>/dev/null; then
      echo "kernel tests under PDL did not pass: chain stopped" >> "$DIR/steps.txt"; return 0
    fi
    step pt_pdl_tokens 60 240 bash -c "$PY $TOKENS --output-json $DIR/pt_off.json && \
      env '$PDL' $PY $TOKENS --output-json $DIR/pt_on.json && \
      $PY -m jaxllm.benchmarks.greedy_tokens --compare $DIR/pt_off.json $DIR/pt_on.json"
    for q in none awq fp8; do
      local quant="" name=pl
      [ $q = none ] || quant="-q $q"
      [ $q = fp8 ] && name=pf
      step ${name}_latency_${q} 80 240 bash -c "$PY $lat $quant --output-json $DIR/${name}_${q}_off.json \
        && env '$PDL' $PY $lat $quant --output-json $DIR/${name}_${q}_on.json"
    done
  }
  return 0
}

summary() {
  grep -h "replies" "$DIR"/pt_*.log 2>/dev/null
  for log in "$DIR"/pl_*.log "$DIR"/pf_*.log; do
    [ -f "$log" ] && { echo "${log##*/}"; grep -hE "^ +[0-9]+ |^llama" "$log" | cut -c1-200; }
  done
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
