export PYTHONPATH=. PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 JAXLLM_COMMIT=b5570ab
S="bash benchmarks/h200_stage.sh"
$S env 30
ENG="--max-num-seqs 256 --max-num-batched-tokens 2048 --num-gpu-blocks-override 48000 --unroll-layers"
$S bg 5 tp8b "python3 -m benchmarks throughput --model llama-3-8b --load-format dummy --dtype bfloat16 --num-prompts 1000 $ENG --backend jaxllm,jax-static,hf --devices 0,0,1 --dataset-name sharegpt-like --output-json /tmp/bg/tp8b/tp_8b_sharegpt.json"
$S bg 5 chain0 "bash .devscripts/chain0.sh"
sleep ${WAIT:-530}
OUT=$OUT $S bg-wait 1 tp8b; OUT=$OUT $S bg-wait 1 chain0; ls -la $OUT
