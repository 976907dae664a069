#!/usr/bin/env bash
# The grid-barrier benchmark and GPU tests (the second tree's), then the one-row decode step of
# two trees side by side on one GPU (alternating, one process each, bench latency
# --device-time).
# The trees come as `git archive`s (the device's copy has no .git), made here:
#   mkdir -p .gpu_ab && git archive --format=tar.gz -o .gpu_ab/a.tgz <A> -- . ':!benchmarks/results'
#   git archive --format=tar.gz -o .gpu_ab/b.tgz <B> -- . ':!benchmarks/results'
# and run with the device tool as `bash benchmarks/step_ab.sh` (carry .gpu_ab; ~7 minutes).
# QUANT (default awq) picks the weights; results and logs under $OUT/ab.
nvidia-smi --query-gpu=name --format=csv,noheader
R=/tmp/ab; rm -rf $R; mkdir -p $R/a $R/b "$OUT/ab"
tar xzf .gpu_ab/a.tgz -C $R/a && tar xzf .gpu_ab/b.tgz -C $R/b || exit 1
export PYTHONPATH=. PYTHONUNBUFFERED=1
LAT="-m jaxllm.benchmarks latency --model llama-3-8b --load-format dummy --dtype bfloat16
  --batch-sizes 1 --context-len 1024 --unroll-layers --iters 20 --no-progress --device-time"
run() {
  local tree=$1 name=$2; shift 2
  (cd $R/$tree && timeout "${LIMIT:-150}" python3 "$@" > "$OUT/ab/$name.log" 2>&1
   echo "rc=$?" >> "$OUT/ab/$name.log")
  echo "== $name"; tail -"${TAIL:-4}" "$OUT/ab/$name.log"
}
LIMIT=120 TAIL=12 run b gb -m jaxllm.benchmarks.grid_barrier --layers 4 \
  --output-json "$OUT/ab/gb.json"
LIMIT=90 TAIL=12 run b gb_small -m jaxllm.benchmarks.grid_barrier --layers 4 \
  --phase-mb 1,1,1,1 --output-json "$OUT/ab/gb_small.json"
LIMIT=150 TAIL=6 run b gpu_tests -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_grid_barrier.py tests/test_rope_kv_write.py
for round in 1 2; do
  for tree in a b; do
    # shellcheck disable=SC2086
    run $tree "l1_${QUANT:-awq}_${tree}_$round" $LAT -q "${QUANT:-awq}" \
      --output-json "$OUT/ab/l1_${QUANT:-awq}_${tree}_$round.json"
  done
done
# shellcheck disable=SC2086
run b l1_bf16_b $LAT --output-json "$OUT/ab/l1_bf16_b.json"
