#!/usr/bin/env bash
# Issue 14's chain for benchmarks/gpu_chain.sh (kind nvidia-h200-x2, or GPUS=1): offline
# throughput with the counted accounting (output tokens from what each backend produced, one
# KV-waste definition, sampled peak memory), Llama-3-8B shape, dummy bf16, jaxllm beside the
# tuned Hugging Face baseline on both workloads; then, as the budget allows, transformers'
# continuous batching (hf-cb) and vLLM's hf. A wrong token count fails its step (exit 2).
#   call 1:   JAXLLM_COMMIT=<commit> bash benchmarks/h200_issue14.sh start &&
#             bash benchmarks/h200_issue14.sh wait 480
#   call 2+:  bash benchmarks/h200_issue14.sh wait 560        (status, stop as gpu_chain.sh)
#
# Steps (two H200s; the chain skips a step that its budget cannot fit):
#   s1 sharegpt-like 1000: hf-tuned (GPU 1, ~12.5 min) | jaxllm (GPU 0, ~2.5 min), then
#   s2 random 512/128 1000: jaxllm, then hf-tuned (GPU 0, ~4 min)                  ~13 min
#   s3 random 512/128 1000: hf-cb (GPU 0) | hf, vLLM-style (GPU 1)                ~5 min
#   s4 sharegpt-like, first 256 prompts: hf-cb (GPU 0) | jaxllm then hf (GPU 1)   ~4 min
#   s5 sharegpt-like 1000: hf-cb alone (GPU 0)                                    ~6 min
# GPUS=1 runs s1 and s2 one backend after the other on one GPU (~19 min) and skips the rest.
# Environment: MODEL (llama-3-8b), DTYPE (bfloat16), PY, HF_PYTHON (= PY), N (1000), N_SMALL
# (256), SHAREGPT_WORKLOAD, RANDOM_WORKLOAD, ENGINE (the engine flags of the earlier H200
# runs), HF_TUNED_CACHE (auto), GPUS (2), and gpu_chain.sh's BUDGET (1500), DIR, OUT.
MODEL=${MODEL:-llama-3-8b}; DTYPE=${DTYPE:-bfloat16}; PY=${PY:-python3}; HF_PYTHON=${HF_PYTHON:-$PY}
N=${N:-1000}; N_SMALL=${N_SMALL:-256}; GPUS=${GPUS:-2}
SHAREGPT=${SHAREGPT_WORKLOAD:---dataset-name sharegpt-like}
RANDOM_WL=${RANDOM_WORKLOAD:---dataset-name random --input-len 512 --output-len 128}
ENGINE=${ENGINE:---max-num-seqs 256 --max-num-batched-tokens 2048 --num-gpu-blocks-override 48000 --unroll-layers}
HF_TUNED_CACHE=${HF_TUNED_CACHE:-auto}

# throughput NAME NEEDS LIMIT FLAGS...: one bench run, its JSON beside its log
throughput() {
  local name=$1; shift
  # shellcheck disable=SC2086  # word splitting of the flag strings is intended
  step "$name" "$1" "$2" $PY -m jaxllm.benchmarks throughput --model "$MODEL" --load-format \
    dummy --dtype "$DTYPE" --no-progress --hf-python "$HF_PYTHON" --hf-tuned-cache \
    "$HF_TUNED_CACHE" $ENGINE "${@:3}" --output-json "$DIR/$name.json"
}

steps() {
  # sharegpt-like lengths vary (4..1024 each way): a static cache would hold every row at the
  # run's longest 2048 tokens, so hf-tuned keeps the dynamic cache there (sorted, sdpa). It
  # needs ~730 s of one GPU, so it has GPU 1 to itself while GPU 0 runs jaxllm on the same
  # prompts and then both backends, one after the other, on random 512/128.
  # shellcheck disable=SC2086
  if [ "$GPUS" = 1 ]; then
    throughput s1_sharegpt 240 1080 $SHAREGPT --num-prompts "$N" --backend jaxllm,hf-tuned \
      --hf-tuned-cache dynamic
    throughput s2_random 150 480 $RANDOM_WL --num-prompts "$N" --backend jaxllm,hf-tuned
    return
  fi
  # shellcheck disable=SC2086
  {
    throughput s1_sharegpt_hf-tuned 240 900 $SHAREGPT --num-prompts "$N" --backend hf-tuned \
      --devices 1 --hf-tuned-cache dynamic &
    throughput s1_sharegpt_jaxllm 120 420 $SHAREGPT --num-prompts "$N" --backend jaxllm \
      --devices 0
    throughput s2_random 150 480 $RANDOM_WL --num-prompts "$N" --backend jaxllm,hf-tuned \
      --devices 0,0
    wait
    throughput s3_random 240 480 $RANDOM_WL --num-prompts "$N" --backend hf-cb,hf --devices 0,1
    throughput "s4_sharegpt_${N_SMALL}prompts" 200 420 $SHAREGPT --num-prompts "$N_SMALL" \
      --backend hf-cb,jaxllm,hf --devices 0,1,1
    throughput s5_sharegpt 330 600 $SHAREGPT --num-prompts "$N" --backend hf-cb --devices 0
  }
}

summary() { $PY -m jaxllm.benchmarks.chain_summary "$DIR"; }

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  exec bash "$(dirname "$0")/gpu_chain.sh" "$0" "$@"
fi
