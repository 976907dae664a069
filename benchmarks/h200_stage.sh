#!/usr/bin/env bash
# One stage of the H200 measurements, each bounded by its own timeout, logs under $OUT.
# Usage (repo root, GPU machine): OUT=/dir bash benchmarks/h200_stage.sh STAGE [SECONDS] [ARGS...]
# The device's copy of .git lags the tree: put JAXLLM_COMMIT=<commit computed here> in front so
# that result JSONs name the right source.
# Stages:
#   env               device, driver, versions
#   latency MODEL     decode step at batch 1/32/256, ctx 1k, layers scanned and unrolled
#   kernel-tests      pytest -m gpu over the kernel test classes (ARGS: extra pytest args)
#   kernels           benchmarks/kernels.py (ARGS: its flags)
#   mixed-step        benchmarks/mixed_step.py: a mixed step's attention, prefill kernel alone
#                     vs decode + prefill kernels (ARGS: its flags)
#   generate-step MODEL  benchmarks/generate_step.py: generate()'s prefill and decode step vs
#                     the output capacity (jax-static's cost) (ARGS: its flags)
#   engine-step MODEL benchmarks/engine_step.py, async, default backend (ARGS: its flags)
#   throughput MODEL  python -m jaxllm.benchmarks throughput (ARGS: its flags; --model is set)
#   serve MODEL RATES python -m jaxllm.serve in the background, bench serve at each rate (ARGS: server
#                     flags), then SIGTERM
#   cache-save / cache-load TAR   carry the engine's XLA compilation cache between calls
#   hlo MODEL         optimized HLO of one batch-256 decode step (pass --unroll-layers and
#                     --pool-blocks N for the engine-sized case): pool copies, big allocations
#   bg NAME CMD...    start CMD in its own session (it outlives this call while the machine
#                     stays warm: the next call must come within its 30 s); log and exit code
#                     under /tmp/bg. For runs longer than one call (hf's sharegpt baseline).
#   bg-wait NAME      wait up to SECONDS for it, then copy its log, exit code and any files
#                     it wrote under /tmp/bg/NAME/ to $OUT
set -o pipefail
STAGE=$1; LIMIT=${2:-300}; shift 2 || shift $#
OUT=${OUT:-/tmp/h200}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
PY=${PYTHON:-python3}
log() { echo "== $STAGE $* ($(date -u +%H:%M:%S))"; }
t0=$(date +%s)
case $STAGE in
  env)
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    $PY -c 'import jax, jaxlib, flax, torch, transformers; print("jax", jax.__version__,
      "flax", flax.__version__, "torch", torch.__version__, "transformers",
      transformers.__version__, jax.devices())'
    git rev-parse --short HEAD; git status --short | head -20 ;;
  latency)
    MODEL=$1; shift
    for unroll in --no-unroll-layers --unroll-layers; do
      log "$MODEL $unroll"
      timeout "$LIMIT" $PY -m jaxllm.benchmarks latency --model "$MODEL" --load-format dummy \
        --dtype bfloat16 --batch-sizes 1,32,256 --context-len 1024 $unroll --no-progress \
        --output-json "$OUT/latency_${MODEL}${unroll#--}.json" "$@" 2>&1 \
        | grep -v "^WARNING\|^I0000" | tail -12
    done ;;
  kernel-tests)
    timeout "$LIMIT" $PY -m pytest tests/test_paged_attention_kernels.py \
      tests/test_paged_attention_generation.py -m gpu \
      -p no:cacheprovider -W ignore::DeprecationWarning -rA "$@" > "$OUT/pytest_gpu.log" 2>&1
    echo "pytest rc=$?"
    grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/pytest_gpu.log" | tail -40 ;;
  kernels)
    timeout "$LIMIT" $PY benchmarks/kernels.py --out "$OUT/kernels.json" "$@" \
      > "$OUT/kernels.log" 2>&1
    echo "kernels rc=$?"
    grep -v "^  sweep\|^  prefill\|^decode {" "$OUT/kernels.log" | tail -30 ;;
  mixed-step)
    timeout "$LIMIT" $PY benchmarks/mixed_step.py --out "$OUT/mixed_step.json" "$@" 2>&1 \
      | grep -v "^WARNING\|^I0000" | tail -6 ;;
  generate-step)
    MODEL=$1; shift
    timeout "$LIMIT" $PY benchmarks/generate_step.py --model "$MODEL" \
      --out "$OUT/generate_step_${MODEL##*/}.json" "$@" 2>&1 | grep -v "^WARNING\|^I0000" | tail -8 ;;
  engine-step)
    MODEL=$1; shift
    timeout "$LIMIT" $PY -m jaxllm.benchmarks.engine_step --model "$MODEL" --load-format dummy \
      --dtype bfloat16 --output-json "$OUT/engine_step_${MODEL}.json" "$@" 2>&1 | tail -3 ;;
  throughput)
    MODEL=$1; shift
    timeout "$LIMIT" $PY -m jaxllm.benchmarks throughput --model "$MODEL" --load-format dummy \
      --dtype bfloat16 --no-progress "$@" > "$OUT/throughput_${MODEL}_$(date +%H%M%S).log" 2>&1
    echo "throughput rc=$?"
    grep -h "warm-up\|Throughput\|/ hf\|Error\|error:" "$OUT"/throughput_"${MODEL}"_*.log \
      | grep -v "^E1\|^W1" | cut -c1-400 | tail -12 ;;
  serve)  # MODEL RATES [server flags...]: one server, bench serve at each comma-separated rate
    MODEL=$1; RATES=$2; shift 2
    $PY -m jaxllm.serve --model "$MODEL" --load-format dummy --dtype bfloat16 --port 8000 \
      --disable-log-requests "$@" > "$OUT/server_${MODEL}.log" 2>&1 &
    server=$!
    until curl -sf localhost:8000/health > /dev/null; do
      sleep 2
      if ! kill -0 $server 2>/dev/null || (( $(date +%s) - t0 > LIMIT )); then
        echo "server not up"; tail -5 "$OUT/server_${MODEL}.log"; kill $server; exit 1; fi
    done
    log "server up after $(( $(date +%s) - t0 )) s"
    for rate in ${RATES//,/ }; do
      timeout $(( LIMIT - ($(date +%s) - t0) )) $PY -m jaxllm.benchmarks serve --base-url \
        http://127.0.0.1:8000 --dataset-name sharegpt-like --num-prompts "${NUM_PROMPTS:-1000}" \
        --request-rate "$rate" --save-result --result-dir "$OUT" --no-progress \
        --result-filename "serve_${MODEL}_rate${rate}.json" 2>&1 | grep -v "^WARNING" | tail -32
    done
    # The official client, when this machine has it (token-id prompt: dummy models have no
    # tokenizer).
    $PY - <<'PYEOF' 2>&1 | tail -3
try:
    import openai
except ImportError:
    print("openai client: not installed here")
else:
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=[1, 2, 3, 4], max_tokens=8)
    print(f"openai {openai.__version__} client: {model} finish_reason="
          f"{out.choices[0].finish_reason}, usage {out.usage}")
PYEOF
    kill -TERM $server; wait $server
    grep -i "error\|traceback" "$OUT/server_${MODEL}.log" | head -5 ;;
  cache-save)  # the engine's XLA cache into one file under $OUT (carry it to the next call)
    tar -C ~/.cache/jaxllm -cf "$OUT/xla_cache.tar" xla && ls -la "$OUT/xla_cache.tar" ;;
  cache-load)  # ARG: a tar from cache-save
    mkdir -p ~/.cache/jaxllm && tar -C ~/.cache/jaxllm -xf "$1" && du -sh ~/.cache/jaxllm/xla ;;
  hlo)  # MODEL [latency flags]: dump the optimized HLO of one decode step and show pool copies
    MODEL=$1; shift
    rm -rf /tmp/hlo
    # No persistent cache here: a cache hit skips the compile and its buffer-assignment dump.
    JAX_COMPILATION_CACHE_DIR= \
    XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" timeout "$LIMIT" \
      $PY -m jaxllm.benchmarks latency --model "$MODEL" --load-format dummy --dtype bfloat16 \
      --batch-sizes 256 --context-len 1024 --iters 3 --warmup-iters 1 --no-progress "$@" 2>&1 \
      | grep -v "^WARNING\|^I0000" | tail -5
    for f in $(ls -S /tmp/hlo/*jit_step*after_optimizations.txt | head -1); do
      echo "== $f"; grep -c "" "$f"
      echo "-- copies of pool-shaped or larger buffers:"
      grep -E " (copy|copy-start|transpose)\(" "$f" | grep -E "\[[0-9]+,[0-9]{4,}," | cut -c1-300 | head -20
      base=${f%after_optimizations.txt}
      head -24 "${base}"*memory-usage-report.txt
      echo "-- allocations of 1 GB or more:"
      grep -E "^allocation [0-9]+: size [0-9]{10,}" "${base}"*buffer-assignment.txt \
        | cut -c1-240 | head -12
    done
    tar -C /tmp -czf "$OUT/hlo_dump.tgz" --exclude="*.o" --exclude="*.ptx" --exclude="*.ll" hlo \
      && ls -la "$OUT/hlo_dump.tgz" ;;
  bg)
    NAME=$1; shift; mkdir -p "/tmp/bg/$NAME"; rm -f "/tmp/bg/$NAME.rc"
    setsid nohup bash -c "$*; echo \$? > /tmp/bg/$NAME.rc" > "/tmp/bg/$NAME.log" 2>&1 < /dev/null &
    log "started $NAME: $*" ;;
  bg-wait)
    NAME=$1
    until [ -f "/tmp/bg/$NAME.rc" ] || (( $(date +%s) - t0 > LIMIT )); do sleep 5; done
    if [ -f "/tmp/bg/$NAME.rc" ]; then log "$NAME exited $(cat "/tmp/bg/$NAME.rc")"
    else log "$NAME still running"; fi
    tr '\r' '\n' < "/tmp/bg/$NAME.log" | grep -v "^W1\|^E1\|^I0000" | tail -15
    cp "/tmp/bg/$NAME.log" "$OUT/bg_$NAME.log"
    [ -n "$(ls -A "/tmp/bg/$NAME" 2>/dev/null)" ] && tar -C /tmp/bg -czf "$OUT/bg_$NAME.tgz" "$NAME"
    true ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
echo "== $STAGE done in $(( $(date +%s) - t0 )) s"
