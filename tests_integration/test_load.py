"""Many concurrent ChatAgent sessions through the real pool, runner actors, capture servers,
router and engines: nothing fails. The small version of `benchmarks/rollout_load.py` (same
code), which measures capture's added latency at 256 sessions."""

import importlib.util
from pathlib import Path

BENCHMARK = Path(__file__).parents[1] / "benchmarks" / "rollout_load.py"


def test_64_concurrent_sdk_sessions_streaming_and_not_have_no_errors(rollout, tiny_model,
                                                                     tmp_path):  # fmt: skip
    spec = importlib.util.spec_from_file_location("rollout_load", BENCHMARK)
    load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load)

    result = load.run_load(rollout, tiny_model, sessions=64, steps=2, max_tokens=8,
                           trace_dir=str(tmp_path))  # fmt: skip
    assert result["errors"] == {}
    calls = result["calls"]
    assert len(calls) >= 2 * 64 * load.TURNS  # every rollout of both batches, each turn
    streamed = sum(c["stream"] for c in calls)
    assert 0 < streamed < len(calls)
    assert all(c["sdk_s"] >= c["engine_s"] > 0 for c in calls)  # each SDK call holds its own
