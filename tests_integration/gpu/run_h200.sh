#!/usr/bin/env bash
# On the H200, after the GPU kit's install call (docs/development.md, "GPU tests"):
#   bash tests_integration/gpu/run_h200.sh [pytest args]
# Installs what molt-train needs beyond the kit (tyro and typeguard wheels in .gpu/extra), puts
# the packages' sources on the path and runs tests_integration/gpu. Logs go to $OUT if set.
set -uo pipefail
# shellcheck source=/dev/null
. .gpu/bin/env.sh
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if compgen -G ".gpu/extra/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/extra/*.whl 2>&1 | tail -2
fi
for p in packages/*/src; do PYTHONPATH=$PWD/$p:$PYTHONPATH; done
PYTHONPATH=$PWD/tests_integration/gpu:$PYTHONPATH  # Ray workers import the tests' actor classes
export PYTHONPATH RAY_AUTH_MODE=disabled
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
timeout "${GPU_TESTS_TIMEOUT:-540}" python3 -m pytest -q -s -p no:cacheprovider tests_integration/gpu "$@" \
  2>&1 | tee "$OUT/gpu_tests.txt"
rc=${PIPESTATUS[0]}
# Engine, router and run logs of every test, for a failure read back here.
find /tmp/pytest-of-* \( -name '*.log' -o -name 'metrics.jsonl' \) -size -2M 2>/dev/null \
  | head -40 | while read -r f; do cp "$f" "$OUT/$(echo "$f" | tr '/' '_')"; done
exit "$rc"
