# Call 3: GPU0 serve Llama-3-8B at 10 and inf; GPU1 offline random 512/128, three backends.
export PYTHONPATH=. PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
O=/tmp/o; mkdir -p $O; T0=$(date +%s); END=$((T0 + ${BUDGET:-400}))
left() { echo $((END - $(date +%s))); }
CUDA_VISIBLE_DEVICES=1 timeout $(left) python3 -m benchmarks throughput --model llama-3-8b --load-format dummy --dtype bfloat16 --num-prompts 1000 --max-num-seqs 256 --max-num-batched-tokens 2048 --num-gpu-blocks-override 48000 --unroll-layers --backend jaxllm,hf,jax-static --dataset-name random --input-len 512 --output-len 128 --output-json $O/tp_8b_random.json > $O/tp_8b_random.log 2>&1 &
A=$!
CUDA_VISIBLE_DEVICES=0 NUM_PROMPTS=1000 OUT=$O bash benchmarks/h200_stage.sh serve $(( $(left) - 10 )) llama-3-8b 10,inf --unroll-layers --num-gpu-blocks-override 48000
echo "serve done at $(( $(date +%s) - T0 )) s"
wait $A; echo "random rc=$? at $(( $(date +%s) - T0 )) s"
tr '\r' '\n' < $O/tp_8b_random.log | grep -h "Throughput\|/ hf\|Error\|error:\|hf generate\|jax-static:" | grep -v "^W1\|^E1" | cut -c1-300 | tail -10
tar -C /tmp -czf $OUT/o.tgz o; ls -la $OUT
