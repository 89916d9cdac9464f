#!/usr/bin/env bash
# RL on one GPU node. Two layouts (docs/operating.md):
#
#   bash recipes/single_node_gpu.sh colocated MODEL DATA [flags...]   one GPU: engine + policy
#   bash recipes/single_node_gpu.sh split     MODEL DATA [flags...]   eight GPUs: 4 engines, 4 ranks
#
# MODEL: a Hugging Face model directory or hub id; DATA: a JSONL/Parquet prompt file
# (docs/concepts/rollout.md, "Prompt data"). Extra flags override the recipe's.
set -euo pipefail
[[ $# -ge 3 ]] || { sed -n '2,9p' "$0" >&2; exit 2; }
layout=$1 model=$2 data=$3
shift 3
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}  # a private single-node Ray

common=(
  --actor.model_path "$model"      # policy weights; the engines serve the same checkpoint
  --data.train_files "$data"       # prompts, one row per prompt
  --vllm.dtype bfloat16            # engine weights in bf16, as the trainer computes
  --train.output_dir runs          # run directories: runs/<run name>
)

case $layout in
  colocated)
    # --train.colocate: the engine and the policy share the GPU; weights move by CUDA-IPC
    #   handle, and the engine takes 0.45 of the GPU's memory (--vllm.gpu_memory_utilization).
    # --actor.num_workers 1: one policy rank, on the engine's GPU.
    exec molt-train "${common[@]}" --train.colocate --actor.num_workers 1 "$@"
    ;;
  split)
    # --vllm.num_engines 4: four vLLM servers behind the session-affine router, one GPU each.
    # --actor.num_workers 4: four FSDP2 ranks on the other four GPUs; refit over NCCL.
    exec molt-train "${common[@]}" --vllm.num_engines 4 --actor.num_workers 4 "$@"
    ;;
  *) sed -n '2,9p' "$0" >&2; exit 2 ;;
esac
