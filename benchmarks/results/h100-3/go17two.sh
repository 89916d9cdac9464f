#!/usr/bin/env bash
# #17's 8-step two-engine run with bare vLLM in the same process, on the full kit installed in
# $SITE (default /tmp/kit, beside go12's /tmp/site), detached; wait10.sh WAITFOR=two.done.
set -u
export SITE=${SITE:-/tmp/kit}
. tests_integration/gpu/env_h200.sh || exit 1
R=/tmp/res; mkdir -p $R
log() { echo "$*" >> $R/progress.txt; }
log "== two-setup $(date +%T) $(nvidia-smi --query-gpu=name --format=csv,noheader)"
python3 benchmarks/gpu_rollout.py --write /tmp/q3r > $R/write_q3r.txt 2>&1 || { tail -5 $R/write_q3r.txt >> $R/progress.txt; touch $R/two.done; exit 1; }
log "== two $(date +%T)"
O=/tmp/two M=/tmp/two/molt/metrics.jsonl seen=0  # checkpoints stay out of $R
# On an 80 GB card the two engines sleep through each training step (docs/benchmarks.md, h100-2).
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
SLEEP=""; if [[ $mem -lt 100000 ]]; then SLEEP="--vllm.enable_sleep_mode"; fi
log "== sleep mode: ${SLEEP:-off}"
timeout 1500 python3 benchmarks/gpu_rollout.py --model /tmp/q3r --steps 8 --out $O --molt-args \
  "--vllm.num_engines 2 --vllm.engines_per_gpu 2 --vllm.gpu_memory_utilization 0.45 --train.partial_rollout_enable False --ckpt.export_hf False $SLEEP" \
  > $R/two.txt 2>&1 &
pid=$!
while kill -0 $pid 2>/dev/null; do sleep 5
  n=$(wc -l < $M 2>/dev/null || echo 0)
  if [[ $n -gt $seen ]]; then python3 .gpu/bin/show.py $M | tail -n +$((seen + 1)) >> $R/progress.txt; seen=$n; fi
done
wait $pid; log "== two rc=$? $(date +%T)"
tar -C /tmp -cf - --exclude=checkpoints --exclude="*.safetensors" --exclude="*.pt" two | tar -C $R -xf -
grep -h -e "ratio" -e "tokens/s" $R/two.txt | tail -8 >> $R/progress.txt
touch $R/two.done
