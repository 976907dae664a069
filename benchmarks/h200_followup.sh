#!/usr/bin/env bash
# The second call of a session whose headline chain (benchmarks/h200_headlines.sh) ran first:
# issue 19's 100% case beside 0% (random 512/128, Llama-3-8B shape) and issue 16's warm
# restart from a converted checkpoint (jaxllm convert of the dummy 8B shape, then a cold and
# a warm start over one cache directory, benchmarks/warm_restart.py).
#   JAXLLM_COMMIT=<commit> BUDGET=380 bash benchmarks/h200_followup.sh start &&
#   bash benchmarks/h200_followup.sh wait 560
HERE=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=benchmarks/h200_structured.sh
source "$HERE/h200_structured.sh"   # throughput (with the SmolLM2 tokenizer for the grammars)
CONVERTED=${CONVERTED:-/tmp/llama-3-8b-orbax}

steps() {
  # shellcheck disable=SC2086
  throughput f1_random_constrained0 150 240 $RANDOM_WL --num-prompts "$N"
  # shellcheck disable=SC2086
  throughput f2_random_constrained100 60 120 $RANDOM_WL --num-prompts "$N" \
    --structured-fraction 1
  rm -rf "$CONVERTED"
  step f3_convert 120 150 $PY -m jaxllm convert llama-3-8b "$CONVERTED" --load-format dummy \
    --dtype bfloat16 --unroll-layers
  step f4_warm_restart 60 200 $PY -m jaxllm.benchmarks.warm_restart --model "$CONVERTED" \
    --starts cold,warm --max-num-seqs 256 --max-num-batched-tokens 2048 \
    --output-json "$DIR/f4_warm_restart.json"
  return 0
}

summary() { $PY -m jaxllm.benchmarks.chain_summary "$DIR"; }

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
