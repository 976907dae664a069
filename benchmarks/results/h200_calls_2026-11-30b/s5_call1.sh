# Session 5 call 1 (nvidia-h200-x2): generate() decode step vs capacity on both GPUs; when
# jax-static's step no longer grows with its cache, start Llama-2-7B item 1 and the GPU0 chain.
export PYTHONPATH=. PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 JAXLLM_COMMIT=${C:?set C}
S="bash benchmarks/h200_stage.sh"; T0=$(date +%s)
t() { echo "-- $* at $(( $(date +%s) - T0 )) s"; }
$S env 30
mkdir -p /tmp/gs
(CUDA_VISIBLE_DEVICES=0 OUT=/tmp/gs $S generate-step 240 llama-3-8b --batch-size 256 --prompt-len 256 --capacities 128,1024 > /tmp/gs/g0.log 2>&1) &
(rm -rf /tmp/hlo; CUDA_VISIBLE_DEVICES=1 JAX_COMPILATION_CACHE_DIR= XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" OUT=/tmp/gs $S generate-step 240 llama-2-7b --batch-size 64 --prompt-len 256 --capacities 128,1024 > /tmp/gs/g1.log 2>&1) &
wait; t generate-steps
cat /tmp/gs/g0.log /tmp/gs/g1.log; cp /tmp/gs/*.json /tmp/gs/*.log $OUT/
for f in $(ls -S /tmp/hlo/*jit_run*after_optimizations.txt | head -2); do python3 .devscripts/hlo_big.py 256 $f; done 2>&1 | head -40 | tee $OUT/hlo_big.txt
ok=$(python3 -c "
import json; r=json.load(open('/tmp/gs/generate_step_llama-2-7b.json'))['rows']
a,b=r[0]['decode_ms'],r[-1]['decode_ms']; print(int(b < 1.5*a + 3 and b < 40))" 2>&1)
t "decision ok=$ok"
[ "$ok" = 1 ] || exit 0
$S bg 5 chain0 "bash .devscripts/s5_chain0.sh"
$S bg 5 tpl2 "python3 -m benchmarks throughput --model llama-2-7b --load-format dummy --dtype bfloat16 --num-prompts 1000 --max-num-seqs 256 --max-num-batched-tokens 2048 --num-gpu-blocks-override 12000 --unroll-layers --jax-static-batch-size 64 --hf-max-batch-size 64 --backend jaxllm,jax-static,hf --devices 0,0,1 --dataset-name sharegpt-like --output-json /tmp/bg/tpl2/tp_l2_sharegpt.json"
sleep $(( 585 - ($(date +%s) - T0) ))
OUT=$OUT $S bg-wait 1 chain0; OUT=$OUT $S bg-wait 1 tpl2
