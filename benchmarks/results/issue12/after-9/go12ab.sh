#!/usr/bin/env bash
# #12 after 5883c02 (no host reads mid-step): go12.sh (ratios at 8,192 tokens on an 80 GB card),
# then the RL step alone, before (.gpu/before: cd377da's packages) and after, twice each,
# alternating, on one checkpoint. Carry .gpu/mini .gpu/bin .gpu/before; detached; wait10.sh.
set -u
bash .gpu/bin/go12.sh
. tests_integration/gpu/env_h200.sh || exit 1
R=/tmp/res; log() { echo "$*" >> $R/progress.txt; }
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
TOK=16384; [[ $mem -lt 100000 ]] && { TOK=8192; export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; }
BEFORE=$PWD/.gpu/before/packages
for k in $(seq ${AB:-2}); do
  for side in before after; do
    P=$PYTHONPATH; [[ $side == before ]] && P=$BEFORE/molt-algos/src:$BEFORE/molt-train/src:$PYTHONPATH
    PYTHONPATH=$P timeout 300 torchrun --nproc-per-node 1 benchmarks/actor_vs_automodel.py --model /tmp/q3 \
      --out $R/ab_${side}_$k --sections main,profile --entropy-coefs 0 --steps 5 --variants rl \
      --profile-variants rl --resident one --tokens-per-step $TOK --seq-lens 8192,2048 --default-seq-len 8192 --fwd-variants "" \
      > $R/ab_${side}_$k.txt 2>&1
    log "== ab $side $k rc=$? $(grep -h -e 'entropy off\]' -e '^profile' $R/ab_${side}_$k.txt | head -3 | cut -c1-160 | tr '\n' ' ')"
  done
done
touch $R/ab.done
