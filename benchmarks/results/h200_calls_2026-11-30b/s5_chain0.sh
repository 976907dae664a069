# GPU0 chain (bg): waits for tpl2's jax-static, then the 8B offline re-measure, serving at inf, kernel tests.
export CUDA_VISIBLE_DEVICES=0
O=/tmp/bg/chain0; S="bash benchmarks/h200_stage.sh"; T0=$(date +%s)
t() { echo "-- $* at $(( $(date +%s) - T0 )) s"; }
sleep 20
until [ -f /tmp/bg/tpl2/tp_l2_sharegpt.jax-static.json ] || [ -f /tmp/bg/tpl2.rc ]; do sleep 3; done; sleep 10
t "GPU0 free"
OUT=$O $S throughput 300 llama-3-8b --backend jaxllm --dataset-name sharegpt-like --num-prompts 1000 --max-num-seqs 256 --max-num-batched-tokens 2048 --num-gpu-blocks-override 48000 --unroll-layers --output-json $O/tp_8b_sharegpt_jaxllm.json; t tp-8b
NUM_PROMPTS=1000 OUT=$O $S serve 300 llama-3-8b inf --unroll-layers --num-gpu-blocks-override 48000; t serve-8b-inf
OUT=$O $S kernel-tests 400 -k Mixed; t kernel-tests
t "chain done"
