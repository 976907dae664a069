#!/usr/bin/env bash
# One H200, one chain (benchmarks/gpu_chain.sh) for the figures of issues 17, 19 and 16 after
# the 2026-12-02 host-path, front-end detokenization, grammar-thread, int4 GEMV and executable
# cache changes, in priority order (steps the budget cannot hold are skipped):
#   h1/h3  offline sharegpt-like (Llama-3-8B shape, dummy bf16), before and after the server
#   h2     served through `jaxllm serve` at rate inf and 10 (tokenizer padded to 128,256 ids, so
#          every sampled id decodes to text, as a real model's would)
#   h4-h7  issue 19's pairs: random 512/128 with 0% and 25% of requests under a JSON schema
#   h8     int4 projections: bf16 vs the tiled kernel vs the GEMV (8B and 70B shapes)
#   h9/h10 decode step latency, AWQ int4 vs bf16, batch 1 and 16
#   h11    the host path per step at 256 and 1024 running sequences (tiny model, this host)
#   call 1:   JAXLLM_COMMIT=<commit> bash benchmarks/h200_headlines.sh start &&
#             bash benchmarks/h200_headlines.sh wait 560
#   call 2+:  bash benchmarks/h200_headlines.sh wait 560
# Needs .gpu_deps/ carried: pyzmq, llguidance, smollm2_tokenizer.json and tokenizer_128k.json
# (python -m jaxllm.benchmarks.export_tokenizer .gpu_deps/tokenizer_128k.json --vocab-size 128256).
HERE=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=benchmarks/h200_serving.sh
source "$HERE/h200_serving.sh"      # offline, served
# shellcheck source=benchmarks/h200_structured.sh
source "$HERE/h200_structured.sh"   # throughput (with the SmolLM2 tokenizer for the grammars)
SERVE_FLAGS=${SERVE_FLAGS:---tokenizer .gpu_deps/tokenizer_128k.json}
LATENCY="--model llama-3-8b --load-format dummy --dtype bfloat16 --batch-sizes 1,16 --context-len 1024 --unroll-layers"

steps() {
  offline h1_offline 150 300
  export -f served
  step h2_served 150 300 bash -c "DIR=$DIR PY=$PY MODEL=$MODEL DTYPE=$DTYPE N=$N \
    N_RATED=200 ENGINE='$ENGINE' SERVE_FLAGS='$SERVE_FLAGS'; served h2_core inf,10"
  offline h3_offline 90 200
  for r in 1 2; do
    throughput "h$((2 + 2 * r))_r${r}_random_constrained0" 90 200 $RANDOM_WL --num-prompts "$N"
    throughput "h$((3 + 2 * r))_r${r}_random_constrained25" 90 200 $RANDOM_WL \
      --num-prompts "$N" --structured-fraction 0.25
  done
  # shellcheck disable=SC2086
  step h8_int4_matmul 60 150 $PY -m jaxllm.benchmarks.int4_matmul --models 8b,70b \
    --tokens 1,4,16 --output-json "$DIR/h8_int4.json"
  # shellcheck disable=SC2086
  step h9_latency_awq 90 180 $PY -m jaxllm.benchmarks latency $LATENCY --quantization awq \
    --output-json "$DIR/h9_latency_awq.json"
  # shellcheck disable=SC2086
  step h10_latency_bf16 60 150 $PY -m jaxllm.benchmarks latency $LATENCY \
    --output-json "$DIR/h10_latency_bf16.json"
  step h11_host_step 40 90 $PY -m jaxllm.benchmarks.host_step --num-seqs 256 1024 \
    --prefix-caching off --output-json "$DIR/h11_host_step.json"
  return 0
}

summary() { $PY -m jaxllm.benchmarks.chain_summary "$DIR"; }

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$HERE/gpu_chain.sh" "$0" "$@"
fi
