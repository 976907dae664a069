#!/usr/bin/env bash
# Issue 18's pipeline-parallel chain for benchmarks/gpu_chain.sh (kind nvidia-h200-x2): PP = 2
# across two H200s of one host against TP = 2, dummy bf16 weights of the real shapes.
#   call 1:   JAXLLM_COMMIT=<commit> bash benchmarks/h200_pp.sh start && bash benchmarks/h200_pp.sh wait 480
#   call 2+:  bash benchmarks/h200_pp.sh wait 560        (status, stop as gpu_chain.sh)
#
# Steps (the chain skips a step its budget cannot fit):
#   parity_pp2            SmolLM2 through LLM at PP 2 vs one GPU, greedy, Pallas kernels on the
#                         micro-batches (the GPU check of jaxllm.parallel.pipeline)
#   lat70_pp2             Llama-3-70B decode step at batch 1/64/256 (M = pp = 2 micro-batches,
#                         stages' layers unrolled: the GPU default)
#   lat70_pp2_m1          the same with one micro-batch (no overlap, weights read once)
#   lat70_pp2_scan        the same with each stage's layers scanned
#   lat70_tp2             TP = 2, for comparison in the same run
#   thr70_pp2, thr70_tp2  Llama-3-70B offline sharegpt-like, N prompts (jaxllm)
# Environment: PY, ENGINE, MODEL70 (llama-3-70b), N (1000), BATCHES (1,64,256), CONTEXT (1024),
# DTYPE (bfloat16), and gpu_chain.sh's BUDGET, DIR, OUT.
PY=${PY:-python3}
ENGINE=${ENGINE:---max-num-seqs 256 --max-num-batched-tokens 2048}
MODEL70=${MODEL70:-llama-3-70b}; N=${N:-1000}; BATCHES=${BATCHES:-1,64,256}
CONTEXT=${CONTEXT:-1024}; DTYPE=${DTYPE:-bfloat16}
DUMMY="--load-format dummy --dtype $DTYPE --no-progress"

steps() {
  # shellcheck disable=SC2086
  step parity_pp2 60 300 $PY -m jaxllm.benchmarks.pp_parity -pp 2 \
    --output-json "$DIR/parity_pp2.json"
  # shellcheck disable=SC2086
  step lat70_pp2 200 480 $PY -m jaxllm.benchmarks latency --model "$MODEL70" $DUMMY \
    --context-len "$CONTEXT" --batch-sizes "$BATCHES" -pp 2 --output-json "$DIR/lat70_pp2.json"
  # shellcheck disable=SC2086
  step lat70_pp2_m1 200 480 $PY -m jaxllm.benchmarks latency --model "$MODEL70" $DUMMY \
    --context-len "$CONTEXT" --batch-sizes "$BATCHES" -pp 2 --pp-micro-batches 1 \
    --output-json "$DIR/lat70_pp2_m1.json"
  # shellcheck disable=SC2086
  step lat70_pp2_scan 200 480 $PY -m jaxllm.benchmarks latency --model "$MODEL70" $DUMMY \
    --context-len "$CONTEXT" --batch-sizes "$BATCHES" -pp 2 --no-unroll-layers \
    --output-json "$DIR/lat70_pp2_scan.json"
  # shellcheck disable=SC2086
  step lat70_tp2 200 480 $PY -m jaxllm.benchmarks latency --model "$MODEL70" $DUMMY \
    --context-len "$CONTEXT" --batch-sizes "$BATCHES" -tp 2 --output-json "$DIR/lat70_tp2.json"
  # shellcheck disable=SC2086
  step thr70_pp2 300 600 $PY -m jaxllm.benchmarks throughput --model "$MODEL70" $DUMMY \
    $ENGINE --dataset-name sharegpt-like --num-prompts "$N" --backend jaxllm -pp 2 \
    --output-json "$DIR/thr70_pp2.json"
  # shellcheck disable=SC2086
  step thr70_tp2 300 600 $PY -m jaxllm.benchmarks throughput --model "$MODEL70" $DUMMY \
    $ENGINE --dataset-name sharegpt-like --num-prompts "$N" --backend jaxllm -tp 2 \
    --output-json "$DIR/thr70_tp2.json"
}

summary() { $PY -m jaxllm.benchmarks.chain_summary "$DIR"; }

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$(dirname "$0")/gpu_chain.sh" "$0" "$@"
fi
