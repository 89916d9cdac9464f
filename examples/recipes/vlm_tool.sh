#!/usr/bin/env bash
# A vision-language agent with tools on geometry figures drawn by the example
# (docs/environments/vlm_tool.md), on one GPU: the vLLM engine and the policy share it.
#
#   bash examples/recipes/vlm_tool.sh [molt-train flags...]
#   LAYOUT=node bash examples/recipes/vlm_tool.sh   # 8 GPUs: 4 engines, 4 policy ranks
#
# MODEL: an Idefics3 checkpoint (the SmolVLM family: Molt's image path takes Idefics3 today).
# The recipe saves a copy of it under runs/ with the processor's image splitting off (one tile
# per image), which Molt requires. DATA: where the figures are written (default runs/geometry).
# Extra flags override the recipe's. Run it from the repository root with molt-examples installed.
set -euo pipefail
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}  # a private single-node Ray

model=${MODEL:-HuggingFaceTB/SmolVLM-Instruct}
data=${DATA:-runs/geometry}
one_tile=runs/$(basename "$model")-one-tile

[[ -f $data/geometry_train.jsonl ]] || python -m molt_examples.vlm_tool "$data"
if [[ ! -f $one_tile/config.json ]]; then
  python - "$model" "$one_tile" <<'PY'
import sys

from huggingface_hub import snapshot_download
from transformers import AutoProcessor

source, target = sys.argv[1:]
snapshot_download(source, local_dir=target)
processor = AutoProcessor.from_pretrained(target)
processor.image_processor.do_image_splitting = False
processor.save_pretrained(target)
PY
fi

case ${LAYOUT:-gpu} in
  gpu) layout=(--train.colocate --actor.num_workers 1 --vllm.enable_sleep_mode True --train.partial_rollout_enable False) ;;
  node) layout=(--vllm.num_engines 4 --actor.num_workers 4) ;;
  *) echo "LAYOUT is gpu or node, not $LAYOUT" >&2; exit 2 ;;
esac

exec molt-train \
  --train.agent_path molt_examples.vlm_tool \
  --data.train_files "$data/geometry_train.jsonl" --data.eval_files "$data/geometry_eval.jsonl" \
  --actor.model_path "$one_tile" --vllm.dtype bfloat16 \
  --rollout.max_tokens 256 --rollout.max_len 4096 \
  --algo.advantage.estimator grpo --rollout.groups_per_batch 32 \
  --rollout.n_samples_per_prompt 8 --actor.optim.lr 1e-6 \
  --eval.every_steps 20 --eval.n_samples 4 --eval.temperature 0.6 \
  --train.num_steps 200 --ckpt.every_steps 50 --ckpt.best_metric eval/pass@1 \
  --train.output_dir runs "${layout[@]}" "$@"
