#!/usr/bin/env bash
# Issue 17's serving goals on one H200 (chain for benchmarks/gpu_chain.sh): the Llama-3-8B
# shape (dummy bf16), sharegpt-like, 1000 prompts, offline and served through `jaxllm serve`
# with the engine core in its own process (the default since it landed) at rate inf and 10,
# (rate 10 with N_RATED=300 prompts: its latencies), then offline again (the pair brackets the
# machine's drift), FP8 W8A8 offline (issue 16's >= 1.4x goal), and last, when the budget
# allows, the same server with the engine on a thread of the server process
# (JAXLLM_ENABLE_MULTIPROCESSING=0, the arrangement before) at rate inf.
#   call 1:   JAXLLM_COMMIT=<commit> bash benchmarks/h200_serving.sh start &&
#             bash benchmarks/h200_serving.sh wait 540
#   call 2+:  bash benchmarks/h200_serving.sh wait 560
# Needs pyzmq in .gpu_deps/ (carried; nothing installs there): cp -r .venv/lib/python3.12/
# site-packages/{zmq,pyzmq.libs,pyzmq-*.dist-info} .gpu_deps/, carry=[".gpu_deps"].
MODEL=${MODEL:-llama-3-8b}; DTYPE=${DTYPE:-bfloat16}; PY=${PY:-python3}; N=${N:-1000}
ENGINE=${ENGINE:---max-num-seqs 256 --max-num-batched-tokens 2048 --num-gpu-blocks-override 48000 --unroll-layers}
SERVE_RATES=${SERVE_RATES:-inf,10}
# SERVE_FLAGS: more server flags, e.g. "--tokenizer .gpu_deps/smollm2_tokenizer.json" (dummy
# weights have no tokenizer; with one the client needs no logprobs to see every token).
# ONLY: the steps to run (default all); FP8_ENV: environment for the fp8 step (XLA_FLAGS).
SERVE_FLAGS=${SERVE_FLAGS:-}; ONLY=${ONLY:-s1 s2 s3 s4 s5}
export PYTHONPATH=.:.gpu_deps
want() { [[ " $ONLY " == *" $1 "* ]]; }

offline() {
  local name=$1; shift
  # shellcheck disable=SC2086  # word splitting of the flag strings is intended
  step "$name" "$1" "$2" env ${STEP_ENV:-} $PY -m jaxllm.benchmarks throughput --model "$MODEL" --load-format \
    dummy --dtype "$DTYPE" --no-progress --backend jaxllm $ENGINE --dataset-name sharegpt-like \
    --num-prompts "$N" "${@:3}" --output-json "$DIR/$name.json"
}

# served NAME RATES [env assignments...]: one server, `bench serve` at each rate, then SIGTERM.
served() {
  local name=$1 rates=$2; shift 2
  # shellcheck disable=SC2086
  env "$@" $PY -m jaxllm.serve --model "$MODEL" --load-format dummy --dtype "$DTYPE" \
    --port 8000 --disable-log-requests $ENGINE $SERVE_FLAGS > "$DIR/${name}_server.log" 2>&1 &
  local server=$! t0=$SECONDS
  until curl -sf localhost:8000/health > /dev/null; do
    sleep 2
    if ! kill -0 $server 2>/dev/null || (( SECONDS - t0 > 300 )); then
      echo "server not up"; tail -5 "$DIR/${name}_server.log"; kill $server; return 1; fi
  done
  echo "server up after $(( SECONDS - t0 )) s"
  for rate in ${rates//,/ }; do
    local n=$N; [ "$rate" != inf ] && n=${N_RATED:-300}  # a paced run: its latencies, not volume
    local file="${name}_rate${rate}.json" again=2  # a rate run again keeps the first's file
    while [ -f "$DIR/$file" ]; do file="${name}_rate${rate}_run${again}.json"; again=$((again + 1)); done
    $PY -m jaxllm.benchmarks serve --base-url http://127.0.0.1:8000 --dataset-name \
      sharegpt-like --num-prompts "$n" --request-rate "$rate" --save-result --result-dir "$DIR" \
      --no-progress --result-filename "$file" 2>&1 | grep -v "^WARNING" \
      | tail -32
  done
  kill -TERM $server; wait $server
  echo "server exit code $?"
  grep -i "error\|traceback" "$DIR/${name}_server.log" | head -5
}

steps() {
  want s1 && offline s1_offline 150 300
  export -f served
  want s2 && step s2_served_core_process 150 300 bash -c "DIR=$DIR PY=$PY MODEL=$MODEL \
    DTYPE=$DTYPE N=$N ENGINE='$ENGINE' SERVE_FLAGS='$SERVE_FLAGS'; served s2_core $SERVE_RATES"
  want s3 && offline s3_offline 90 200
  want s4 && STEP_ENV=${FP8_ENV:-} offline s4_offline_fp8 120 300 --quantization fp8
  want s5 && step s5_served_in_process 90 200 bash -c "DIR=$DIR PY=$PY MODEL=$MODEL \
    DTYPE=$DTYPE N=$N ENGINE='$ENGINE' SERVE_FLAGS='$SERVE_FLAGS'; served s5_thread inf \
    JAXLLM_ENABLE_MULTIPROCESSING=0"
  return 0
}

summary() { $PY -m jaxllm.benchmarks.chain_summary "$DIR"; }

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$(dirname "$0")/gpu_chain.sh" "$0" "$@"
fi
