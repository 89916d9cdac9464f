#!/usr/bin/env bash
# One-call lease for #12: AutoModel's wheels alone (.gpu/mini, no vLLM), then the side-by-side
# after the compiled log-prob blocks (2K/8K, gather, profile), detached; wait10.sh brings it back.
set -u
SITE=/tmp/site
if [[ ! -f $SITE/.mini ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .gpu/mini/*.whl > /tmp/pip.log 2>&1 \
    || { tail -20 /tmp/pip.log; exit 1; }
  touch $SITE/.mini
fi
. tests_integration/gpu/env_h200.sh || exit 1
R=/tmp/res; mkdir -p $R
log() { echo "$*" >> $R/progress.txt; }
log "== start $(date +%T) $(nvidia-smi --query-gpu=name --format=csv,noheader)"
python3 -c "import nemo_automodel, transformers; print('automodel', nemo_automodel.__version__, 'transformers', transformers.__version__)" >> $R/progress.txt 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
python3 benchmarks/actor_vs_automodel.py --write-model /tmp/q3 > $R/write_q3.txt 2>&1 || { tail -5 $R/write_q3.txt >> $R/progress.txt; touch $R/actor.done; exit 1; }
log "== actor $(date +%T)"
# An 80 GB card holds one 1.7B model's step at a time, and the bare step only at 8,192 tokens
# (docs/benchmarks.md, after-8): there the ratios come from 8,192-token steps, one model
# resident at a time, and a second run times the RL step alone at the 16,384 tokens.
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
RES=both; TOK=16384
if [[ $mem -lt 100000 ]]; then RES=one; TOK=8192; export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; fi
timeout 900 torchrun --nproc-per-node 1 benchmarks/actor_vs_automodel.py --model /tmp/q3 --out $R/actor \
  --sections ${SECTIONS:-main,gather,profile} --entropy-coefs 0 --steps 3 --variants "${V:-rl,bare,bare+auto}" \
  --resident $RES --tokens-per-step $TOK --seq-lens 8192,2048 --default-seq-len 8192 \
  --fwd-variants bare+auto --profile-variants "${PV:-rl,bare+auto}" > $R/actor.txt 2>&1
log "== actor rc=$? $(date +%T) resident=$RES tokens=$TOK"
grep -h -e "forward-only" -e "entropy off\]" -e "gather" -e "step ratio" -e "FAILED" -e "^profile" $R/actor.txt >> $R/progress.txt
if [[ $RES == one ]]; then
  timeout 600 torchrun --nproc-per-node 1 benchmarks/actor_vs_automodel.py --model /tmp/q3 --out $R/actor16k \
    --sections main --entropy-coefs 0 --steps 3 --variants rl --resident one \
    --seq-lens 8192,2048 --fwd-variants "" > $R/actor16k.txt 2>&1
  log "== actor16k rc=$? $(date +%T)"
  grep -h -e "entropy off\]" -e "forward-only ratio" -e "FAILED" $R/actor16k.txt >> $R/progress.txt
fi
touch $R/actor.done
[[ -n ${SKIP_LOGPROB:-} ]] && { touch $R/all.done; exit 0; }
export PYTHONPATH=$PWD/packages/molt-algos/src:$PYTHONPATH
python3 benchmarks/algos_logprob.py --device cuda > $R/logprob.txt 2>&1
python3 benchmarks/algos_logprob.py --device cuda --no-entropy --modes forward+backward > $R/logprob_noent.txt 2>&1
grep -h "^| forward" $R/logprob.txt $R/logprob_noent.txt >> $R/progress.txt
touch $R/all.done
