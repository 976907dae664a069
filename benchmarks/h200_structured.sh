#!/usr/bin/env bash
# Structured outputs on one H200 (chain for benchmarks/gpu_chain.sh): offline throughput of
# the Llama-3-8B shape (dummy bf16), random 512/128, 1000 prompts, with 0%, 25% and 100% of the
# requests constrained to a JSON schema (benchmarks/jax_backends.py STRUCTURED_SCHEMA), then
# sharegpt-like, 1000 prompts, unconstrained (the offline headline after the fused-column
# reorder). The grammars index SmolLM2's tokenizer (49,152 of the model's 128,256 ids; the
# other ids are never allowed): Llama 3's own tokenizer is not on the machine.
#   call 1:   JAXLLM_COMMIT=<commit> bash benchmarks/h200_structured.sh start &&
#             bash benchmarks/h200_structured.sh wait 480
#   call 2+:  bash benchmarks/h200_structured.sh wait 560
# Needs llguidance and the tokenizer in .gpu_deps/ (carried; nothing installs there):
#   cp -r .venv/lib/python3.12/site-packages/llguidance{,-1.9.1.dist-info} .gpu_deps/ (the
#   dist-info too: llguidance reads its version from it), carried with carry=[".gpu_deps"],
#   and the tokenizer.json
#   from `python -m jaxllm.benchmarks.export_tokenizer .gpu_deps/smollm2_tokenizer.json`.
MODEL=${MODEL:-llama-3-8b}; DTYPE=${DTYPE:-bfloat16}; PY=${PY:-python3}; N=${N:-1000}
RANDOM_WL=${RANDOM_WORKLOAD:---dataset-name random --input-len 512 --output-len 128}
ENGINE=${ENGINE:---max-num-seqs 256 --max-num-batched-tokens 2048 --num-gpu-blocks-override 48000 --unroll-layers}
TOKENIZER=${TOKENIZER:-.gpu_deps/smollm2_tokenizer.json}
export PYTHONPATH=.:.gpu_deps

throughput() {
  local name=$1; shift
  # shellcheck disable=SC2086  # word splitting of the flag strings is intended
  step "$name" "$1" "$2" $PY -m jaxllm.benchmarks throughput --model "$MODEL" --load-format \
    dummy --dtype "$DTYPE" --no-progress --backend jaxllm --tokenizer "$TOKENIZER" $ENGINE \
    "${@:3}" --output-json "$DIR/$name.json"
}

# REPEATS=k runs the 0% / 25% pair k times, alternating (the 25% loss is a few percent, about
# the spread between runs); ONLY_PAIRS=1 leaves out the 100% and sharegpt-like runs.
steps() {
  # shellcheck disable=SC2086
  {
    for r in $(seq 1 "${REPEATS:-1}"); do
      throughput "r${r}_random_constrained0" 150 420 $RANDOM_WL --num-prompts "$N"
      throughput "r${r}_random_constrained25" 90 300 $RANDOM_WL --num-prompts "$N" \
        --structured-fraction 0.25
    done
    [ -n "${ONLY_PAIRS:-}" ] && return
    throughput s3_random_constrained100 90 300 $RANDOM_WL --num-prompts "$N" \
      --structured-fraction 1
    throughput s4_sharegpt 120 420 --dataset-name sharegpt-like --num-prompts "$N"
  }
}

summary() { $PY -m jaxllm.benchmarks.chain_summary "$DIR"; }

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$(dirname "$0")/gpu_chain.sh" "$0" "$@"
fi
