export PYTHONPATH=. PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
O=/tmp/o; mkdir -p $O; L="python3 -m benchmarks latency --load-format dummy --dtype bfloat16 --context-len 1024 --no-progress"
(for u in --no-unroll-layers --unroll-layers; do CUDA_VISIBLE_DEVICES=1 timeout 170 $L --model llama-2-7b --batch-sizes 1,32,256 $u --output-json $O/lat_l2_${u#--}.json; done > $O/lat_l2.txt 2>&1) &
CUDA_VISIBLE_DEVICES=0 timeout 160 $L --model llama-3-8b --batch-sizes 32,256 --unroll-layers --pool-blocks 50000 --output-json $O/lat_8b_pool.json > $O/lat_8b.txt 2>&1
grep -v "^WARN\|^I0000" $O/lat_8b.txt | tail -8
T=$(grep -h "batch 256: compiled" $O/lat_8b.txt | sed 's/.*needs \([0-9.]*\) GB.*/\1/')
U=$(python3 -c "print('--unroll-layers' if float('${T:-999}') < 20 else '')"); echo "temps=$T flag=$U"
wait; grep -v "^WARN\|^I0000" $O/lat_l2.txt | tail -20
OUT=$O bash benchmarks/h200_stage.sh throughput 380 llama-3-8b --backend jaxllm,hf,jax-static --devices 0,1 --dataset-name sharegpt-like --num-prompts 1000 --max-num-seqs 256 --max-num-batched-tokens 2048 $U --output-json $O/tp_8b_sharegpt.json
grep -h "compil\|warm" $O/throughput_*.log | grep -v "^W1\|^E1" | cut -c1-200 | tail -8
tar -C /tmp -czf $OUT/o.tgz o; ls -la $OUT
