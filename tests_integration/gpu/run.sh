#!/usr/bin/env bash
# The GPU tests on a CUDA machine, from the repository's root:
#   bash tests_integration/gpu/run.sh [pytest args]      # e.g. -k colocated
# Needs the four packages installed with their CUDA and test extras (molt-rollout[cuda,test],
# molt-train[cuda,test]; docs/development.md gives the commands), or the GPU image
# (containers/Dockerfile.gpu) with pytest and pytest-asyncio added.
# test_two_gpus.py needs two CUDA devices and is skipped with one.
set -euo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
# vLLM finds Molt's weight-transfer backends through molt-rollout's entry point: an installed
# package, not sources on the path.
if ! python -c "from importlib.metadata import entry_points as e
assert any(p.value.startswith('molt_rollout.') for p in e(group='vllm.general_plugins'))"; then
  echo "molt-rollout is not installed as a package: vLLM would not find its plugin" >&2
  exit 1
fi
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}  # the tests' private local Ray
# Ray's workers unpickle the actor classes the test modules define by module name.
export PYTHONPATH="$PWD/tests_integration/gpu${PYTHONPATH:+:$PYTHONPATH}"
exec python -m pytest -q -s -p no:cacheprovider tests_integration/gpu "$@"
