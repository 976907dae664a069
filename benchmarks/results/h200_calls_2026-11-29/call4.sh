export PYTHONPATH=. PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
O=/tmp/o; mkdir -p $O; B=${BUDGET:-190}
(CUDA_VISIBLE_DEVICES=1 timeout $B python3 -m benchmarks latency --load-format dummy --dtype bfloat16 --context-len 1024 --no-progress --model llama-2-7b --batch-sizes 1,32,128 --unroll-layers --output-json $O/lat_l2_unrolled.json > $O/lat_l2.txt 2>&1) &
timeout $B python3 -m benchmarks throughput --model llama-3-8b --load-format dummy --dtype bfloat16 --num-prompts 64 --max-num-seqs 64 --max-num-batched-tokens 2048 --num-gpu-blocks-override 8193 --unroll-layers --backend jaxllm,hf --devices 0,1 --dataset-name random --input-len 1536 --output-len 512 --no-progress --output-json $O/mem_8b_2048.json > $O/mem.log 2>&1
echo "mem rc=$?"; grep -h "Throughput\|/ hf\|Error" $O/mem.log | cut -c1-300
wait; grep -v "^WARN\|^I0000\|^W1\|^E1" $O/lat_l2.txt | tail -8
tar -C /tmp -czf $OUT/o.tgz o
