#!/usr/bin/env bash
# Issue 14 on a two-GPU H200 (kind nvidia-h200-x2): offline throughput with the new accounting
# (output tokens counted from what each backend produced, one KV-waste definition, sampled peak
# memory), Llama-3-8B shape, dummy bf16, jaxllm on GPU 0 beside the tuned Hugging Face baseline
# on GPU 1 for both workloads; then, as the chain's budget allows, transformers' continuous
# batching (hf-cb) and vLLM's hf. Every run writes JSON; a wrong token count fails its run
# (exit 2), is shown as WRONG TOKEN COUNT by `status` and makes the chain's exit code non-zero.
#
# The chain runs in the background (setsid), so several device calls of at most 10 minutes
# poll the same run; each call must come within 30 s of the last (the machine stays warm that
# long; a fresh machine has lost the chain). From the repo root on the GPU machine:
#   call 1:   JAXLLM_COMMIT=<commit> bash benchmarks/h200_issue14.sh start &&
#             bash benchmarks/h200_issue14.sh wait 480
#   call 2+:  bash benchmarks/h200_issue14.sh wait 560
#   any time: bash benchmarks/h200_issue14.sh status   (or stop: the chain and its step)
# `wait` copies the results to $OUT: issue14_status.txt, issue14_results.tgz (JSONs, logs).
#
# Steps (expected time on two H200s; the chain skips a step that its budget cannot fit):
#   s1 sharegpt-like 1000: hf-tuned (GPU 1, ~12.5 min) | jaxllm (GPU 0, ~2.5 min), then
#   s2 random 512/128 1000: jaxllm, then hf-tuned (GPU 0, ~4 min)                  ~13 min
#   s3 random 512/128 1000: hf-cb (GPU 0) | hf, vLLM-style (GPU 1)                ~5 min
#   s4 sharegpt-like, first 256 prompts: hf-cb (GPU 0) | jaxllm then hf (GPU 1)   ~4 min
#   s5 sharegpt-like 1000: hf-cb alone (GPU 0)                                    ~6 min
# s4 is labelled by its prompt count: vLLM's hf needs ~16 minutes for 1000 sharegpt-like
# prompts on one H200. Ratios across steps of one workload compare identical prompts (same
# dataset and seed).
#
# Environment (defaults for the H200; the CPU dry run overrides them):
#   MODEL (llama-3-8b), DTYPE (bfloat16), PY (python3), HF_PYTHON (= PY), N (1000),
#   N_SMALL (256), SHAREGPT_WORKLOAD ("--dataset-name sharegpt-like"), RANDOM_WORKLOAD
#   ("--dataset-name random --input-len 512 --output-len 128"), ENGINE (the engine flags of
#   the earlier H200 runs), HF_TUNED_CACHE (auto), BUDGET (seconds of chain time, 1500), DIR
#   (/tmp/issue14), GPUS (2; 1 runs s1 and s2 one backend after the other on one GPU, ~19 min,
#   and skips the rest).
set -o pipefail
CMD=${1:-status}; LIMIT=${2:-540}
DIR=${DIR:-/tmp/issue14}; OUT=${OUT:-$DIR/out}
MODEL=${MODEL:-llama-3-8b}; DTYPE=${DTYPE:-bfloat16}; PY=${PY:-python3}; HF_PYTHON=${HF_PYTHON:-$PY}
N=${N:-1000}; N_SMALL=${N_SMALL:-256}; BUDGET=${BUDGET:-1500}
SHAREGPT=${SHAREGPT_WORKLOAD:---dataset-name sharegpt-like}
RANDOM_WL=${RANDOM_WORKLOAD:---dataset-name random --input-len 512 --output-len 128}
ENGINE=${ENGINE:---max-num-seqs 256 --max-num-batched-tokens 2048 --num-gpu-blocks-override 48000 --unroll-layers}
HF_TUNED_CACHE=${HF_TUNED_CACHE:-auto}; GPUS=${GPUS:-2}
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# throughput NAME SECONDS FLAGS...: one bench run, its JSON and log in DIR
throughput() {
  local name=$1 secs=$2; shift 2
  local t=$SECONDS
  echo "$name started $(date -u +%H:%M:%S), limit ${secs}s" >> "$DIR/steps.txt"
  # Its own process group, so that a step killed at its limit takes its children (the
  # per-backend bench processes, the hf child) with it.
  # shellcheck disable=SC2086  # word splitting of the flag strings is intended
  setsid timeout "$secs" $PY -m jaxllm.benchmarks throughput --model "$MODEL" --load-format \
    dummy --dtype "$DTYPE" --no-progress --hf-python "$HF_PYTHON" --hf-tuned-cache \
    "$HF_TUNED_CACHE" $ENGINE "$@" --output-json "$DIR/$name.json" > "$DIR/$name.log" 2>&1 &
  local pid=$!; echo $pid > "$DIR/$name.pid"
  wait $pid; local rc=$?
  kill -- -$pid 2>/dev/null  # whatever of the step outlived it
  local why=""; [ $rc = 2 ] && why=" (token counts or arguments: see the log)"
  [ $rc = 124 ] && why=" (killed at its ${secs}s limit)"
  echo "$name rc=$rc in $(( SECONDS - t ))s$why" >> "$DIR/steps.txt"
  return $rc
}

# step NAME NEEDS LIMIT ARGS...: runs when the budget still holds NEEDS seconds
step() {
  local name=$1 needs=$2 limit=$3; shift 3
  local left=$(( BUDGET - SECONDS ))
  if (( left < needs )); then echo "$name skipped: ${left}s of budget left, needs $needs" \
    >> "$DIR/steps.txt"; return 0; fi
  throughput "$name" $(( limit < left ? limit : left )) "$@" || touch "$DIR/failed"
}

chain() {
  SECONDS=0; rm -f "$DIR/failed"
  # shellcheck disable=SC2086
  {
    # sharegpt-like lengths vary (4..1024 each way): a static cache would hold every row at the
    # run's longest 2048 tokens, so hf-tuned keeps the dynamic cache there (sorted, sdpa). It
    # needed 730 s of one GPU on 2026-11-30 (600 s killed it), so it has GPU 1 to itself for
    # 900 s while GPU 0 runs jaxllm on the same prompts and then both backends, one after the
    # other, on random 512/128: one backend per GPU at any time.
    if [ "$GPUS" = 1 ]; then  # one backend after the other on the one GPU
      step s1_sharegpt 240 1080 $SHAREGPT --num-prompts "$N" --backend jaxllm,hf-tuned \
        --hf-tuned-cache dynamic
      step s2_random 150 480 $RANDOM_WL --num-prompts "$N" --backend jaxllm,hf-tuned
    else
      step s1_sharegpt_hf-tuned 240 900 $SHAREGPT --num-prompts "$N" --backend hf-tuned \
        --devices 1 --hf-tuned-cache dynamic &
      step s1_sharegpt_jaxllm 120 420 $SHAREGPT --num-prompts "$N" --backend jaxllm --devices 0
      step s2_random 150 480 $RANDOM_WL --num-prompts "$N" --backend jaxllm,hf-tuned \
        --devices 0,0
      wait
    fi
    [ "$GPUS" = 1 ] && BUDGET=0  # the extras below need two GPUs
    step s3_random 240 480 $RANDOM_WL --num-prompts "$N" --backend hf-cb,hf --devices 0,1
    step "s4_sharegpt_${N_SMALL}prompts" 200 420 $SHAREGPT --num-prompts "$N_SMALL" \
      --backend hf-cb,jaxllm,hf --devices 0,1,1
    step s5_sharegpt 330 600 $SHAREGPT --num-prompts "$N" --backend hf-cb --devices 0
  }
  local failed=0; [ -f "$DIR/failed" ] && failed=1
  echo "chain done in ${SECONDS}s, failed=$failed" >> "$DIR/steps.txt"
  echo $failed > "$DIR/done"
}

status() {
  echo "== issue14 $(date -u +%H:%M:%S)"; cat "$DIR/steps.txt" 2>/dev/null
  for log in "$DIR"/*.log; do  # the running step's last progress lines
    [ -f "${log%.log}.json" ] || [ ! -f "$log" ] || [ "$log" = "$DIR/chain.log" ] || {
      echo "-- ${log##*/}:"; tr '\r' '\n' < "$log" | grep -v "^W1\|^E1\|^I0\|^ *$" | tail -4; }
  done
  $PY - "$DIR" <<'EOF'
import glob, json, os, sys
rows, by_workload = [], {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "s*.json"))):
    name = os.path.basename(path)[:-5]
    if "." in name:  # a child's own file (side.<backend>.json): the summary has it
        continue
    with open(path) as f:
        summary = json.load(f)
    a = summary["args"]
    workload = (a["dataset_name"], a["num_prompts"], a["input_len"], a["output_len"])
    for b, r in summary["results"].items():
        ok = r["total_output_tokens"] == r["requested_output_tokens"]
        peak, waste = r.get("peak_memory_bytes"), r.get("kv_waste")
        peak = "-" if peak is None else f"{peak / 2**30:.1f}"
        waste = "-" if waste is None else f"{waste:.1%}"
        rows.append(f"{name:<24} {b:<10} {r['output_tokens_per_second']:>9.1f} "
                    f"{r['elapsed_time']:>7.1f} {r['total_output_tokens']:>8} {peak:>6} "
                    f"{waste:>7} {summary['commit']} {'' if ok else 'WRONG TOKEN COUNT'}")
        if ok:  # no ratio from a run that did other work than asked
            by_workload.setdefault(workload, {}).setdefault(
                b, (r["output_tokens_per_second"], name))
print(f"{'run':<24} {'backend':<10} {'out tok/s':>9} {'timed s':>7} {'out tok':>8} "
      f"{'GiB':>6} {'KV wst':>7}")
print("\n".join(rows))
for w, res in by_workload.items():
    for h in ("hf", "hf-tuned", "hf-cb"):
        if h in res and "jaxllm" in res:
            print(f"{w[0]} {w[1]} prompts: jaxllm / {h} = {res['jaxllm'][0] / res[h][0]:.2f}x "
                  f"({res['jaxllm'][1]} / {res[h][1]})")
EOF
}

case $CMD in
  start)
    : "${JAXLLM_COMMIT:?set JAXLLM_COMMIT to the commit computed off the device (its .git lags)}"
    export JAXLLM_COMMIT
    mkdir -p "$DIR"; rm -f "$DIR"/*.json "$DIR"/*.log "$DIR/steps.txt" "$DIR/done"
    nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv 2>/dev/null
    $PY -c 'import jax; print("jax", jax.__version__, jax.devices())'
    $HF_PYTHON -c 'import torch, transformers; print("torch", torch.__version__,
      torch.cuda.device_count(), "GPUs; transformers", transformers.__version__)'
    setsid nohup bash "$0" chain > "$DIR/chain.log" 2>&1 < /dev/null &
    echo $! > "$DIR/chain.pid"; echo "chain started (pid $(cat "$DIR/chain.pid"))" ;;
  chain) chain ;;
  status) status ;;
  wait)
    t0=$SECONDS
    until [ -f "$DIR/done" ] || (( SECONDS - t0 > LIMIT )); do sleep 10; done
    mkdir -p "$OUT"; status | tee "$OUT/issue14_status.txt"
    tar -C "$DIR" -czf "$OUT/issue14_results.tgz" --exclude=out . 2>/dev/null
    if [ -f "$DIR/done" ]; then exit "$(cat "$DIR/done")"; fi; echo "chain still running" ;;
  stop)  # the chain, then the steps it was running (each its own process group)
    kill -- -"$(cat "$DIR/chain.pid")"
    for pid in "$DIR"/s*.pid; do kill -- -"$(cat "$pid")" 2>/dev/null; done; echo stopped ;;
  *) echo "usage: $0 start|wait SECONDS|status|stop"; exit 2 ;;
esac
