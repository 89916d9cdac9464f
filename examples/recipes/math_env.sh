#!/usr/bin/env bash
# Math word problems with math-verify as the reward (docs/environments/math_env.md), on one GPU:
# the vLLM engine and the policy share it. Two estimators:
#
#   bash examples/recipes/math_env.sh grpo            [molt-train flags...]
#   bash examples/recipes/math_env.sh flash_reinforce [molt-train flags...]
#
# TRAIN, EVAL: GSM8K-format JSONL ({"question", "answer": "... #### 42"}); default: the shipped
# 20-row sample, for a first run only. MATH rows: add --data.prompt_key problem
# --data.label_key solution. MODEL: a Hugging Face model directory or hub id. Extra flags
# override the recipe's. Run it from the repository root with molt-examples[math] installed.
set -euo pipefail
usage() { sed -n '2,11p' "$0" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
variant=$1
shift
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}  # a private single-node Ray

sample=examples/molt_examples/data/gsm8k_sample.jsonl
train=${TRAIN:-$sample}
eval=${EVAL:-$sample}
model=${MODEL:-Qwen/Qwen3-1.7B}

common=(
  --train.agent_path molt_examples.math_env
  --data.train_files "$train" --data.eval_files "$eval"
  --data.prompt_key question --data.label_key answer   # GSM8K's columns
  --actor.model_path "$model" --vllm.dtype bfloat16
  --rollout.chat_template_kwargs enable_thinking False  # Qwen3: reason in the reply, briefly
  --rollout.max_tokens 1024 --rollout.max_len 2048
  --eval.every_steps 20 --eval.n_samples 4 --eval.temperature 0.6 --eval.max_prompts 500
  --train.num_steps 200 --ckpt.every_steps 50 --ckpt.best_metric eval/pass@1
  --train.output_dir runs
  # One GPU: engine and policy share it, weights move by CUDA-IPC handle; the engine sleeps
  # through each training step, so a 1.7B model fits an 80 GB card (docs/operating.md, One GPU).
  # A whole node of 8 GPUs instead: --vllm.num_engines 4 --actor.num_workers 4 in place of the
  # next line.
  --train.colocate --actor.num_workers 1 --vllm.enable_sleep_mode True --train.partial_rollout_enable False
)

case $variant in
  grpo)
    # 32 prompts x 8 samples; each sample's advantage is its reward against its group's.
    # Asynchronous by one batch (the default queue), corrected per token (IS, the default).
    exec molt-train "${common[@]}" --algo.advantage.estimator grpo \
      --rollout.groups_per_batch 32 --rollout.n_samples_per_prompt 8 --actor.optim.lr 1e-6 "$@"
    ;;
  flash_reinforce)
    # One sample per prompt, 256 prompts: the baseline is the batch's mean reward, so no group
    # waits for its slowest sample. On policy, with GSPO's sequence-level trust region and the
    # tight clip range of its paper.
    exec molt-train "${common[@]}" --algo.advantage.estimator flash_reinforce \
      --rollout.groups_per_batch 256 --rollout.n_samples_per_prompt 1 \
      --train.force_on_policy True --algo.policy_loss gspo \
      --algo.loss.clip_low 3e-4 --algo.loss.clip_high 4e-4 --actor.optim.lr 1e-6 "$@"
    ;;
  *) usage ;;
esac
