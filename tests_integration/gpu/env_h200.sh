# shellcheck shell=bash
# Sourced on the H200 after the GPU kit's install call (docs/development.md, "GPU tests"):
#   . tests_integration/gpu/env_h200.sh
# The kit's environment, what Molt needs beyond the kit (.gpu/extra: the tyro, typeguard and
# py-spy wheels, and molt-rollout's own wheel, whose entry point is how vLLM finds Molt's
# plugin: its weight-transfer backends), and the packages' sources first on the path.
# shellcheck source=/dev/null
. .gpu/bin/env.sh
# A target of their own: pip --target leaves out a bin/ that exists (the kit's), so py-spy's
# command would be missing from /tmp/site/bin.
if compgen -G ".gpu/extra/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site-extra .gpu/extra/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=/tmp/site-extra:$PYTHONPATH PATH=/tmp/site-extra/bin:$PATH
if ! python3 -c "from importlib.metadata import entry_points as e
assert any(p.value.startswith('molt_rollout.') for p in e(group='vllm.general_plugins'))"; then
  echo "no molt-rollout entry point: put its wheel in .gpu/extra (docs/development.md)" >&2
  return 1
fi
for p in packages/*/src; do PYTHONPATH=$PWD/$p:$PYTHONPATH; done
PYTHONPATH=$PWD/tests_integration/gpu:$PWD/benchmarks:$PYTHONPATH  # Ray workers import these
export PYTHONPATH RAY_AUTH_MODE=disabled
