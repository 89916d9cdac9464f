#!/usr/bin/env bash
# H100 lease: #17's 8-step two-engine run on an 80 GB GPU, with sleep mode (the trainer's
# cached blocks released before the engines wake), bare vLLM in the same call.
set -u
. tests_integration/gpu/env_h200.sh || exit 1
R=/tmp/res; mkdir -p $R
step() { local name=$1 lim=$2; shift 2; echo "== $name $(date +%T)" >> $R/progress.txt
  timeout $lim "$@" > $R/$name.txt 2>&1 & local pid=$! seen=0 M=$R/$name/molt/metrics.jsonl
  while kill -0 $pid 2>/dev/null; do sleep 3
    n=$(wc -l < $M 2>/dev/null || echo 0)
    if [[ $n -gt $seen ]]; then python3 .gpu/bin/show.py $M | tail -n +$((seen + 1)) >> $R/progress.txt; seen=$n; fi
  done; wait $pid; echo "== $name rc=$? $(date +%T)" >> $R/progress.txt; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpu.txt
python3 benchmarks/gpu_rollout.py --write /tmp/q3r > $R/write.txt 2>&1
step two 840 python3 benchmarks/gpu_rollout.py --model /tmp/q3r --steps 8 --out $R/two --molt-args \
  "--vllm.num_engines 2 --vllm.engines_per_gpu 2 --vllm.gpu_memory_utilization 0.45 --vllm.enable_sleep_mode --train.partial_rollout_enable False --ckpt.export_hf False"
touch $R/two.done $R/all.done
