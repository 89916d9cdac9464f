#!/usr/bin/env bash
# Several reasoning-gym tasks in one run, each scored by its own scorer, with per-task metrics
# (docs/environments/reasoning_gym_env.md), on one GPU: the vLLM engine and the policy share it.
#
#   TASKS="leg_counting basic_arithmetic" bash examples/recipes/reasoning_gym_env.sh [flags...]
#
# TASKS: reasoning-gym dataset names; SIZE: problems per task; MODEL: a Hugging Face model
# directory or hub id. The rows are written to DATA_DIR first (seeded: the same every time;
# the eval rows use another seed). Extra flags override the recipe's. Run it from the
# repository root with molt-examples[gym] installed.
set -euo pipefail
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}  # a private single-node Ray

read -r -a tasks <<< "${TASKS:-leg_counting basic_arithmetic spell_backward chain_sum}"
size=${SIZE:-2000}
model=${MODEL:-Qwen/Qwen3-1.7B}
data_dir=${DATA_DIR:-runs/reasoning_gym_data}
mkdir -p "$data_dir"

write_rows() {  # OUT SIZE SEED
  python -m molt_examples.reasoning_gym_env --tasks "${tasks[@]}" --out "$1" --size "$2" \
    --seed "$3"
}
write_rows "$data_dir/train.jsonl" "$size" 0
write_rows "$data_dir/eval.jsonl" 50 1  # 50 per task: eval/<task>/pass@k

exec molt-train \
  --train.agent_path molt_examples.reasoning_gym_env \
  --data.train_files "$data_dir/train.jsonl" --data.eval_files "$data_dir/eval.jsonl" \
  --actor.model_path "$model" --vllm.dtype bfloat16 \
  --rollout.chat_template_kwargs enable_thinking False \
  --rollout.max_tokens 1024 --rollout.max_len 2048 \
  --algo.advantage.estimator grpo \
  --rollout.groups_per_batch 32 --rollout.n_samples_per_prompt 8 --actor.optim.lr 1e-6 \
  --eval.every_steps 20 --eval.n_samples 4 --eval.temperature 0.6 \
  --train.num_steps 200 --ckpt.every_steps 50 --ckpt.best_metric eval/pass@1 \
  --train.output_dir runs \
  --train.colocate --actor.num_workers 1 --vllm.enable_sleep_mode True --train.partial_rollout_enable False \
  "$@"
# A whole node of 8 GPUs: replace the colocated line with
#   --vllm.num_engines 4 --actor.num_workers 4
