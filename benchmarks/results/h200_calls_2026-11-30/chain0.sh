# GPU0 chain (started by h200_stage.sh bg, outlives a call): waits until the 8B sharegpt run's JAX
# backends leave GPU0 (hf keeps GPU1), then the rest of issue 6's items, most needed first.
export CUDA_VISIBLE_DEVICES=0
O=/tmp/bg/chain0; S="bash benchmarks/h200_stage.sh"; T0=$(date +%s)
t() { echo "-- $* at $(( $(date +%s) - T0 )) s"; }
until [ -f /tmp/bg/tp8b/tp_8b_sharegpt.jax-static.json ] || [ -f /tmp/bg/tp8b.rc ]; do sleep 3; done; sleep 10
t "GPU0 free"
OUT=$O $S kernel-tests 200 -k Mixed; t kernel-tests
NUM_PROMPTS=1000 OUT=$O $S serve 300 llama-3-8b inf --unroll-layers --num-gpu-blocks-override 48000; t serve-8b
L2="--max-num-batched-tokens 2048 --unroll-layers --devices 0"
OUT=$O $S throughput 420 llama-2-7b $L2 --max-num-seqs 256 --num-gpu-blocks-override 12000 --num-prompts 1000 --backend jaxllm,hf,jax-static --dataset-name random --input-len 512 --output-len 128 --output-json $O/tp_l2_random.json; t random-l2
NUM_PROMPTS=1000 OUT=$O $S serve 420 llama-2-7b 10,inf --unroll-layers --num-gpu-blocks-override 12000; t serve-l2
OUT=$O $S throughput 300 llama-2-7b $L2 --max-num-seqs 64 --num-gpu-blocks-override 8193 --num-prompts 64 --backend jaxllm,hf --dataset-name random --input-len 1536 --output-len 512 --output-json $O/mem_l2_2048.json; t mem-l2
OUT=$O $S mixed-step 90; t mixed-step
if (( $(date +%s) - T0 < 1000 )); then
  OUT=$O $S throughput 400 llama-2-7b $L2 --max-num-seqs 256 --num-gpu-blocks-override 12000 --num-prompts 1000 --backend jaxllm,jax-static --dataset-name sharegpt-like --output-json $O/tp_l2_sharegpt.json; t sharegpt-l2
fi
t "chain done"
