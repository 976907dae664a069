#!/usr/bin/env bash
# Issue 15's chain for benchmarks/gpu_chain.sh (kind nvidia-h200-x2): tensor parallelism on
# two H200s of one host, dummy bf16 weights of the real shapes.
#   call 1:   JAXLLM_COMMIT=<commit> bash benchmarks/h200_tp.sh start && bash benchmarks/h200_tp.sh wait 480
#   call 2+:  bash benchmarks/h200_tp.sh wait 560        (status, stop as gpu_chain.sh)
#
# Steps (the chain skips a step its budget cannot fit), TP = 1 on GPU 0 alone:
#   lat8_tp1, lat8_tp2    Llama-3-8B decode step at batch 1/64/256, context 1k, vs roofline
#   thr8_tp1, thr8_tp2    Llama-3-8B offline sharegpt-like, 1000 prompts (jaxllm)
#   prof8_tp2             one TP = 2 decode step at batch 64: collectives placed, their share
#   lat70_tp2             Llama-3-70B decode step at batch 1/64 vs the per-device roofline
#   thr70_tp2             Llama-3-70B offline sharegpt-like, 1000 prompts
#   serve70_tp2           Llama-3-70B served (jaxllm serve -tp 2), bench serve at 2 req/s on
#                         NUM_PROMPTS (200) sharegpt-like prompts, then the official openai
#                         client's completion (h200_stage.sh serve)
# Environment (defaults for the H200; a CPU dry run overrides them): PY, ENGINE (engine flags
# for throughput and serve), NUM_PROMPTS, MODEL8 (llama-3-8b), MODEL70 (llama-3-70b), TP (2),
# DTYPE (bfloat16), N (1000 prompts), BATCHES8 (1,64,256), BATCHES70 (1,64), CONTEXT (1024),
# and gpu_chain.sh's BUDGET (1500), DIR, OUT.
PY=${PY:-python3}
ENGINE=${ENGINE:---max-num-seqs 256 --max-num-batched-tokens 2048 --unroll-layers}
MODEL8=${MODEL8:-llama-3-8b}; MODEL70=${MODEL70:-llama-3-70b}; TP=${TP:-2}; N=${N:-1000}
BATCHES8=${BATCHES8:-1,64,256}; BATCHES70=${BATCHES70:-1,64}; CONTEXT=${CONTEXT:-1024}
DTYPE=${DTYPE:-bfloat16}; DUMMY="--load-format dummy --dtype $DTYPE --no-progress"

latency() {  # NAME NEEDS LIMIT TP MODEL BATCHES
  local gpus=0,1; [ "$4" = 1 ] && gpus=0
  # shellcheck disable=SC2086
  step "$1" "$2" "$3" env CUDA_VISIBLE_DEVICES=$gpus $PY -m jaxllm.benchmarks latency \
    --model "$5" $DUMMY --context-len "$CONTEXT" --batch-sizes "$6" --unroll-layers -tp "$4" \
    --output-json "$DIR/$1.json"
}

throughput() {  # NAME NEEDS LIMIT TP MODEL
  local gpus=0,1; [ "$4" = 1 ] && gpus=0
  # shellcheck disable=SC2086
  step "$1" "$2" "$3" env CUDA_VISIBLE_DEVICES=$gpus $PY -m jaxllm.benchmarks throughput \
    --model "$5" $DUMMY $ENGINE --dataset-name sharegpt-like --num-prompts "$N" \
    --backend jaxllm -tp "$4" --output-json "$DIR/$1.json"
}

steps() {
  latency lat8_tp1 90 300 1 "$MODEL8" "$BATCHES8"
  latency "lat8_tp$TP" 90 300 "$TP" "$MODEL8" "$BATCHES8"
  throughput thr8_tp1 150 420 1 "$MODEL8"
  throughput "thr8_tp$TP" 150 420 "$TP" "$MODEL8"
  # shellcheck disable=SC2086
  step "prof8_tp$TP" 60 240 $PY -m jaxllm.benchmarks.tp_profile --model "$MODEL8" \
    --load-format dummy --dtype "$DTYPE" \
    -tp "$TP" --batch-size 64 --context-len "$CONTEXT" --trace-dir "$DIR/trace_prof8" \
    --output-json "$DIR/prof8_tp$TP.json"
  latency "lat70_tp$TP" 200 480 "$TP" "$MODEL70" "$BATCHES70"
  throughput "thr70_tp$TP" 300 600 "$TP" "$MODEL70"
  # shellcheck disable=SC2086
  step "serve70_tp$TP" 300 600 env NUM_PROMPTS="${NUM_PROMPTS:-200}" OUT="$DIR" PYTHON="$PY" bash \
    benchmarks/h200_stage.sh serve 590 "$MODEL70" 2 -tp "$TP" $ENGINE
}

summary() { $PY -m jaxllm.benchmarks.chain_summary "$DIR"; }

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$(dirname "$0")/gpu_chain.sh" "$0" "$@"
fi
