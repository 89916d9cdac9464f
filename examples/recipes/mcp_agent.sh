#!/usr/bin/env bash
# MCP tools through a stock agent SDK: molt_examples.mcp_agent, unit-conversion word problems
# solved with the calculator and unit converter of molt_examples/mcp_server.py over stdio
# (docs/environments/mcp_agent.md).
#
#   bash examples/recipes/mcp_agent.sh [flags...]                  openai-agents SDK, one GPU
#   SDK=anthropic bash examples/recipes/mcp_agent.sh [flags...]    the Anthropic SDK variant
#   LAYOUT=node bash examples/recipes/mcp_agent.sh [flags...]      one node of 8 GPUs
#
# MODEL (default Qwen/Qwen3-1.7B) and RUNS (default runs) may be set; flags override the
# recipe's. Needs `pip install -e "packages/molt-train" -e "examples[mcp]"`.
set -euo pipefail
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}  # a private single-node Ray
model=${MODEL:-Qwen/Qwen3-1.7B}
runs=${RUNS:-runs}
mkdir -p "$runs"

# 2,000 problems for training (labels from the server's own functions); the 20 shipped rows
# for evaluation.
train="$runs/mcp_units_train.jsonl"
[[ -f $train ]] || python -m molt_examples.mcp_agent "$train" 2000
eval_rows=$(python -c 'import molt_examples, pathlib; print(pathlib.Path(molt_examples.__file__).parent / "data" / "mcp_units.jsonl")')

agent=molt_examples.mcp_agent  # AgentRunner: the openai-agents SDK
if [[ ${SDK:-openai-agents} == anthropic ]]; then
  agent="$runs/mcp_anthropic_agent.py"  # a one-line module naming the other runner
  echo "from molt_examples.mcp_agent import AnthropicAgentRunner as AgentRunner" > "$agent"
fi

common=(
  --train.agent_path "$agent"
  --actor.model_path "$model"
  --data.train_files "$train"
  --data.eval_files "$eval_rows" --eval.every_steps 10
  --rollout.n_samples_per_prompt 8 --rollout.groups_per_batch 16
  --rollout.max_tokens 1024        # per model call; a rollout makes up to 6 (MAX_TURNS)
  --rollout.max_len 8192           # tokens per segment: the tool schemas, calls and results
  --rollout.chat_template_kwargs enable_thinking False  # short replies; tools do the work
  --actor.optim.lr 1e-6
  --vllm.dtype bfloat16
  --train.output_dir "$runs"
)

case ${LAYOUT:-colocated} in
  # The engine and the policy share the GPU; weights move by CUDA-IPC handle; the engine
  # sleeps through each training step (docs/operating.md, One GPU).
  colocated) exec molt-train "${common[@]}" --train.colocate --actor.num_workers 1 \
    --vllm.enable_sleep_mode True --train.partial_rollout_enable False "$@" ;;
  # Four engines behind the router and four FSDP2 ranks; refit over NCCL.
  node) exec molt-train "${common[@]}" --vllm.num_engines 4 --actor.num_workers 4 "$@" ;;
  *) echo "LAYOUT is colocated or node" >&2; exit 2 ;;
esac
