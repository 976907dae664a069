# Call 2 (run inline as the device command): collect the two background jobs of call 1.
export PYTHONPATH=.; S="bash benchmarks/h200_stage.sh"; OUT=$OUT $S bg-wait 555 chain0; OUT=$OUT $S bg-wait 1 tp8b; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv
