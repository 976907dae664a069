#!/usr/bin/env bash
# Host cost of launching a step on one H200 (chain for benchmarks/gpu_chain.sh): the Llama-3-8B
# shape (dummy bf16, unrolled), 256 sequences decoding, with XLA's command buffers (CUDA graphs)
# as by default, off, and extended to every command type (benchmarks/launch_cost.py). The
# default run also dumps the optimized forward and counts its command-buffer calls.
#   call 1:   JAXLLM_COMMIT=<commit> bash benchmarks/h200_launch.sh start &&
#             bash benchmarks/h200_launch.sh wait 480
#   call 2+:  bash benchmarks/h200_launch.sh wait 560
PY=${PY:-python3}
ALL_COMMANDS=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL

launch() {
  local name=$1 flags=$2
  XLA_FLAGS=$flags step "$name" 100 300 $PY -m jaxllm.benchmarks.launch_cost --model llama-3-8b \
    --load-format dummy --dtype bfloat16 --unroll-layers --num-gpu-blocks-override 20000 \
    --output-json "$DIR/$name.json"
}

steps() {
  launch l1_default "--xla_dump_to=$DIR/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*forward.*"
  launch l2_off "--xla_gpu_enable_command_buffer="
  launch l3_all "--xla_gpu_enable_command_buffer=$ALL_COMMANDS --xla_gpu_graph_min_graph_size=1"
}

summary() {
  grep -h "^XLA_FLAGS" "$DIR"/l*.log 2>/dev/null
  for f in "$DIR"/hlo/*forward*after_optimizations.txt; do
    [ -f "$f" ] && echo "$(basename "$f"): $(grep -c 'command_buffer' "$f") command_buffer lines, $(grep -c 'custom-call\|fusion(' "$f") fusion/custom-call lines"
  done
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$(dirname "$0")/gpu_chain.sh" "$0" "$@"
fi
