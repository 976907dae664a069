# Call 2: Llama-3-8B offline sharegpt (3 backends, 2 GPUs), then on GPU0 random 512/128, then serve.
export PYTHONPATH=. PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
O=/tmp/o; mkdir -p $O; T0=$(date +%s); END=$((T0 + ${BUDGET:-570}))
left() { echo $((END - $(date +%s))); }
ENG="--max-num-seqs 256 --max-num-batched-tokens 2048 --num-gpu-blocks-override 48000 --unroll-layers"
TP="python3 -m benchmarks throughput --model llama-3-8b --load-format dummy --dtype bfloat16 --num-prompts 1000 $ENG"
timeout $(left) $TP --backend jaxllm,hf,jax-static --devices 0,1 --dataset-name sharegpt-like --output-json $O/tp_8b_sharegpt.json > $O/tp_8b_sharegpt.log 2>&1 &
A=$!
until [ -f $O/tp_8b_sharegpt.jax-static.json ] || ! kill -0 $A 2>/dev/null; do sleep 3; done
echo "GPU0 free after $(( $(date +%s) - T0 )) s"; grep -h "Throughput\|warm-up\|Error" $O/tp_8b_sharegpt.log | cut -c1-300
if [ $(left) -gt 150 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout $(( $(left) - 5 )) $TP --backend jaxllm,jax-static,hf --dataset-name random --input-len 512 --output-len 128 --no-progress --output-json $O/tp_8b_random.json > $O/tp_8b_random.log 2>&1
  echo "random rc=$? at $(( $(date +%s) - T0 )) s"; grep -h "Throughput\|/ hf\|Error" $O/tp_8b_random.log | cut -c1-300
fi
wait $A; echo "sharegpt rc=$? at $(( $(date +%s) - T0 )) s"
grep -h "Throughput\|/ hf\|Error\|error:" $O/tp_8b_sharegpt.log | grep -v "^W1\|^E1" | cut -c1-300 | tail -8
grep -h "warm\|compil" $O/tp_8b_sharegpt.log | grep -v "^W1\|^E1" | cut -c1-200 | tail -4
tar -C /tmp -czf $OUT/o.tgz o; ls -la $OUT
