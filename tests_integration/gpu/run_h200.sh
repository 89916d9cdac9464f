#!/usr/bin/env bash
# On the H200, after the GPU kit's install call (docs/development.md, "GPU tests"):
#   bash tests_integration/gpu/run_h200.sh [pytest args]
# Sets up the environment (env_h200.sh) and runs tests_integration/gpu. Logs go to $OUT if set.
set -uo pipefail
# shellcheck source=tests_integration/gpu/env_h200.sh
. tests_integration/gpu/env_h200.sh || exit 1
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
timeout "${GPU_TESTS_TIMEOUT:-540}" python3 -m pytest -q -s -p no:cacheprovider tests_integration/gpu "$@" \
  2>&1 | tee "$OUT/gpu_tests.txt"
rc=${PIPESTATUS[0]}
# Engine, router and run logs of every test, for a failure read back here (one file: the
# device tool brings back at most 8).
find /tmp/pytest-of-* \( -name '*.log' -o -name 'metrics.jsonl' \) -size -2M 2>/dev/null \
  | tar -czf "$OUT/test_logs.tgz" -T - 2>/dev/null
exit "$rc"
