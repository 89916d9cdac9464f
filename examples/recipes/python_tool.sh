#!/usr/bin/env bash
# Tool-integrated reasoning: math word problems solved with a sandboxed `python` tool
# (docs/environments/python_tool.md), Qwen3 on one GPU: the vLLM engine and the policy share it.
#
#   bash examples/recipes/python_tool.sh [molt-train flags...]
#   LAYOUT=node bash examples/recipes/python_tool.sh   # 8 GPUs: 4 engines, 4 policy ranks
#
# TRAIN, EVAL: GSM8K-format JSONL ({"question", "answer": "... #### 42"}); default: the shipped
# 20-row sample, for a first run only. MODEL: a Hugging Face model directory or hub id. Extra
# flags override the recipe's. Run it from the repository root with molt-examples installed.
set -euo pipefail
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}  # a private single-node Ray

sample=examples/molt_examples/data/gsm8k_sample.jsonl
train=${TRAIN:-$sample}
eval=${EVAL:-$sample}
model=${MODEL:-Qwen/Qwen3-4B}

case ${LAYOUT:-gpu} in
  # One GPU: engine and policy share it, weights move by CUDA-IPC handle; the engine sleeps
  # through each training step (docs/operating.md, One GPU).
  gpu) layout=(--train.colocate --actor.num_workers 1 --vllm.enable_sleep_mode True --train.partial_rollout_enable False) ;;
  # A node of 8 GPUs: engines on four, the policy sharded over the other four.
  node) layout=(--vllm.num_engines 4 --actor.num_workers 4) ;;
  *) echo "LAYOUT is gpu or node, not $LAYOUT" >&2; exit 2 ;;
esac

exec molt-train \
  --train.agent_path molt_examples.python_tool \
  --data.train_files "$train" --data.eval_files "$eval" \
  --data.prompt_key question --data.label_key answer \
  --actor.model_path "$model" --vllm.dtype bfloat16 \
  --rollout.chat_template_kwargs enable_thinking False \
  --rollout.max_tokens 1024 --rollout.max_len 6144 --rollout.deadline_s 300 \
  --rollout.num_runners 4 --rollout.cpus_per_runner 2 \
  --algo.advantage.estimator grpo --rollout.groups_per_batch 32 \
  --rollout.n_samples_per_prompt 8 --actor.optim.lr 1e-6 \
  --eval.every_steps 20 --eval.n_samples 4 --eval.temperature 0.6 --eval.max_prompts 500 \
  --train.num_steps 200 --ckpt.every_steps 50 --ckpt.best_metric eval/pass@1 \
  --train.output_dir runs "${layout[@]}" "$@"
