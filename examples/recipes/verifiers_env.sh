#!/usr/bin/env bash
# A verifiers environment trained as it is: molt_examples.verifiers_env runs each episode of the
# taskset against Molt's capture server, and the task's rubric gives the reward
# (docs/environments/verifiers_env.md).
#
#   bash examples/recipes/verifiers_env.sh TASKSET_ID [flags...]                one GPU
#   LAYOUT=node bash examples/recipes/verifiers_env.sh TASKSET_ID [flags...]    8 GPUs
#
# TASKSET_ID: an installed taskset, e.g. after `prime env install primeintellect/reverse-text`,
# `reverse-text`. ENV_CONFIG (JSON, verifiers' [env] block) overrides the env config, e.g.
# '{"agent": {"harness": {"id": "null"}}}'; MODEL, RUNS and NUM_TASKS may be set.
# Needs verifiers in its own environment (openai<3): see the docs page.
set -euo pipefail
[[ $# -ge 1 ]] || { sed -n '2,13p' "$0" >&2; exit 2; }
taskset=$1
shift
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}  # a private single-node Ray
model=${MODEL:-Qwen/Qwen3-1.7B}
runs=${RUNS:-runs}
mkdir -p "$runs"

# One row per task: its prompt, and the env config and task data the agent rebuilds it from.
rows="$runs/${taskset//\//_}.jsonl"
[[ -f $rows ]] || python -m molt_examples.verifiers_env "$taskset" "$rows" \
  --num-tasks "${NUM_TASKS:-5000}" --config "${ENV_CONFIG:-{\}}"

common=(
  --train.agent_path molt_examples.verifiers_env
  --actor.model_path "$model"
  --data.train_files "$rows"
  --rollout.n_samples_per_prompt 8 --rollout.groups_per_batch 16
  --rollout.max_tokens 2048 --rollout.max_len 16384
  --rollout.num_runners 4          # each runs its episodes' harness programs on this node
  --actor.optim.lr 1e-6
  --vllm.dtype bfloat16
  --train.output_dir "$runs"
)

case ${LAYOUT:-colocated} in
  colocated) exec molt-train "${common[@]}" --train.colocate --actor.num_workers 1 \
    --vllm.enable_sleep_mode True --train.partial_rollout_enable False "$@" ;;
  node) exec molt-train "${common[@]}" --vllm.num_engines 4 --actor.num_workers 4 "$@" ;;
  *) echo "LAYOUT is colocated or node" >&2; exit 2 ;;
esac
