#!/usr/bin/env bash
# Programmatic dependent launch (PDL) in the one-row decode step on a Hopper GPU (chain for
# benchmarks/gpu_chain.sh). XLA (jax 0.11.2) already compiles every kernel, the Pallas ones
# included, to start with griddepcontrol.wait (ACQBULK in the sm_90 SASS, read on the CPU
# machine; --xla_gpu_enable_pdl=false removes it), but no kernel signals its dependents early,
# so each is launched only as the one before it ends. Int4GemvConfig.trigger_dependents makes
# every GEMV program signal at its start (PREEXIT), so that the kernel after each GEMV is
# placed while the GEMV runs (timed on an H100 on 2026-12-07: slower, so off; RESULTS.md).
# In order:
#   pg  the GEMVs at one token with their modes, the trigger's included, each checked against
#       the reference on the device and timed by the device (the chain stops on a BAD result)
#   pl  the decode step at one row, context 1,024, back to back and by the device's time,
#       Llama-3-8B shape: AWQ by default, with the GEMVs' trigger and without PDL; bf16 by
#       default and without PDL
#   JAXLLM_COMMIT=<commit> BUDGET=420 bash benchmarks/h200_pdl.sh start &&
#     bash benchmarks/h200_pdl.sh wait 430
HERE=$(dirname "${BASH_SOURCE[0]}")
NO_PDL="XLA_FLAGS=--xla_gpu_enable_pdl=false"
ONE_ROW="-m jaxllm.benchmarks latency --model llama-3-8b --load-format dummy --dtype bfloat16
  --batch-sizes 1 --context-len 1024 --unroll-layers --iters 20 --no-progress --device-time"

steps() {
  local lat="${ONE_ROW//$'\n'/ }"  # one line (a newline in bash -c ends the command)
  # shellcheck disable=SC2086
  {
    step pg_gemv_modes 60 200 $PY -m jaxllm.benchmarks.int4_matmul --models 8b \
      --shapes qkv,o,gate_up,down --tokens 1 --gemv-modes --copies 8 --device-time \
      --output-json "$DIR/pg_gemv_modes.json"
    if [ -f "$DIR/failed" ] || grep -q BAD "$DIR/pg_gemv_modes.log"; then
      echo "GEMV checks failed: chain stopped" >> "$DIR/steps.txt"; return 0
    fi
    step pl_awq 100 300 bash -c "$PY $lat -q awq --output-json $DIR/pl_awq.json; \
      $PY $lat -q awq --gemv-overrides trigger_dependents=True \
      --output-json $DIR/pl_awq_trigger.json; \
      env $NO_PDL $PY $lat -q awq --output-json $DIR/pl_awq_no_pdl.json"
    step pl_bf16 60 200 bash -c "$PY $lat --output-json $DIR/pl_bf16.json; \
      env $NO_PDL $PY $lat --output-json $DIR/pl_bf16_no_pdl.json"
  }
  return 0
}

summary() {
  grep -h "trigger\|table\|gate_up\|down" "$DIR"/pg_*.log 2>/dev/null | cut -c1-160 | head -20
  for log in "$DIR"/pl_*.log; do
    [ -f "$log" ] && { echo "${log##*/}"; grep -hE "^ +[0-9]+ |^llama" "$log" | cut -c1-200; }
  done
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
