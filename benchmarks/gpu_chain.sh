#!/usr/bin/env bash
# Runs a chain of benchmark steps in the background on the GPU machine, so that several device
# calls of at most 10 minutes poll one run; each call must come within 30 s of the last (the
# machine stays warm that long; a fresh machine has lost the chain).
#
#   bash benchmarks/gpu_chain.sh CHAIN start            (JAXLLM_COMMIT=<commit> in front: the
#                                                        device copy's .git lags the tree)
#   bash benchmarks/gpu_chain.sh CHAIN wait SECONDS     wait, then copy results to $OUT
#   bash benchmarks/gpu_chain.sh CHAIN status | stop
#
# CHAIN is a file that defines `steps` (calls of `step NAME NEEDS LIMIT COMMAND...`: COMMAND
# runs when the chain's BUDGET still holds NEEDS seconds, killed at LIMIT; its output goes to
# $DIR/NAME.log; `&` and `wait` run steps side by side) and may define `summary` (a table of
# the results in $DIR). `wait` copies $DIR (JSONs, logs) to $OUT/<chain>_results.tgz and the
# status to $OUT/<chain>_status.txt. A step that fails makes the chain's exit code non-zero.
set -o pipefail
CHAIN_FILE=$1; CMD=${2:-status}; LIMIT=${3:-540}
NAME=$(basename "$CHAIN_FILE" .sh)
DIR=${DIR:-/tmp/$NAME}; OUT=${OUT:-$DIR/out}; BUDGET=${BUDGET:-1500}; PY=${PY:-python3}
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
summary() { :; }
# shellcheck source=/dev/null
source "$CHAIN_FILE"

# step NAME NEEDS LIMIT COMMAND...: COMMAND in its own process group (a step killed at its
# limit takes its children with it), when the budget still holds NEEDS seconds.
step() {
  local name=$1 needs=$2 limit=$3; shift 3
  local left=$(( BUDGET - SECONDS ))
  if (( left < needs )); then
    echo "$name skipped: ${left}s of budget left, needs $needs" >> "$DIR/steps.txt"; return 0
  fi
  (( limit > left )) && limit=$left
  local t=$SECONDS
  echo "$name started $(date -u +%H:%M:%S), limit ${limit}s" >> "$DIR/steps.txt"
  setsid timeout "$limit" "$@" > "$DIR/$name.log" 2>&1 &
  local pid=$!; echo $pid > "$DIR/$name.pid"
  wait $pid; local rc=$?
  kill -- -$pid 2>/dev/null
  local why=""; [ $rc = 2 ] && why=" (token counts or arguments: see the log)"
  [ $rc = 124 ] && why=" (killed at its ${limit}s limit)"
  echo "$name rc=$rc in $(( SECONDS - t ))s$why" >> "$DIR/steps.txt"
  [ $rc = 0 ] || touch "$DIR/failed"
}

status() {
  echo "== $NAME $(date -u +%H:%M:%S)"; cat "$DIR/steps.txt" 2>/dev/null
  for log in "$DIR"/*.log; do  # the running steps' last progress lines
    [ "$log" != "$DIR/chain.log" ] && [ -f "${log%.log}.pid" ] && ! grep -q "^$(basename "${log%.log}") rc=" \
      "$DIR/steps.txt" && { echo "-- ${log##*/}:"
      tr '\r' '\n' < "$log" | grep -v "^W1\|^E1\|^I0\|^I1\|^ *$" | tail -4; }
  done
  summary
}

case $CMD in
  start)
    : "${JAXLLM_COMMIT:?set JAXLLM_COMMIT to the commit computed off the device (its .git lags)}"
    export JAXLLM_COMMIT
    mkdir -p "$DIR"; rm -rf "${DIR:?}"/*
    nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv 2>/dev/null
    $PY -c 'import jax; print("jax", jax.__version__, jax.devices())'
    # The chain runs from a copy of the tree: a later device call re-syncs the working tree
    # under it, and a step that starts after that would import the newer files.
    TREE=/tmp/chain_tree_$NAME; rm -rf "$TREE"; mkdir -p "$TREE"
    tar --exclude=./.git --exclude=./.venv -cf - . | tar -C "$TREE" -xf -
    (cd "$TREE" && setsid nohup bash "$0" "$CHAIN_FILE" chain > "$DIR/chain.log" 2>&1 < /dev/null &)
    sleep 1; pgrep -f "$CHAIN_FILE chain" | head -1 > "$DIR/chain.pid"
    echo "chain started (pid $(cat "$DIR/chain.pid")) in $TREE" ;;
  chain)
    SECONDS=0; steps
    failed=0; [ -f "$DIR/failed" ] && failed=1
    echo "chain done in ${SECONDS}s, failed=$failed" >> "$DIR/steps.txt"; echo $failed > "$DIR/done" ;;
  status) status ;;
  wait)
    t0=$SECONDS
    until [ -f "$DIR/done" ] || (( SECONDS - t0 > LIMIT )); do sleep 10; done
    mkdir -p "$OUT"; status | tee "$OUT/${NAME}_status.txt"
    tar -C "$DIR" -czf "$OUT/${NAME}_results.tgz" --exclude=out --exclude='*.pid' --exclude='trace_*' --exclude=hlo . 2>/dev/null
    if [ -f "$DIR/done" ]; then exit "$(cat "$DIR/done")"; fi; echo "chain still running" ;;
  stop)  # the chain, then every step it was running (each its own process group)
    kill -- -"$(cat "$DIR/chain.pid")"
    for pid in "$DIR"/*.pid; do kill -- -"$(cat "$pid")" 2>/dev/null; done; echo stopped ;;
  *) echo "usage: $0 CHAIN start|wait SECONDS|status|stop"; exit 2 ;;
esac
