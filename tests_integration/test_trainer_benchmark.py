"""The trainer benchmark (`benchmarks/actor_vs_automodel.py`) in its CPU form: with one model
in memory at a time (`--resident one`, for an 80 GB GPU) the RL and bare steps still run on the
same tokens and their ratio is joined; a section that needs both models at once is refused
before anything loads."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def benchmark(*args: str) -> subprocess.CompletedProcess:
    with socket.socket() as s:  # the worker's process group (world of one) needs a port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.pathsep.join(p for p in (str(BENCHMARKS), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "MASTER_PORT": str(port)}
    return subprocess.run([sys.executable, str(BENCHMARKS / "actor_vs_automodel.py"), *args],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip


def test_one_model_at_a_time_joins_the_step_ratio(tiny_model, tmp_path):
    out = benchmark("--model", tiny_model, "--cpu", "--resident", "one", "--out", str(tmp_path),
                    "--sections", "main", "--seq-lens", "128", "--default-seq-len", "128",
                    "--tokens-per-step", "256", "--max-tokens-per-microbatch", "256",
                    "--entropy-coefs", "0", "--warmup", "1", "--steps", "2",
                    "--variants", "rl,bare", "--fwd-variants", "")  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RL model freed" in out.stdout
    line = re.search(r"\[128 entropy off\] step ratio ([\d.]+) \(rl ([\d.]+) s, bare ([\d.]+) s\)",
                     out.stdout)  # fmt: skip
    assert line, out.stdout
    ratio, rl, bare = (float(x) for x in line.groups())
    assert abs(ratio - bare / rl) < 0.01 + 0.001 / rl  # tokens/s over tokens/s: time inverted
    rows = {r["variant"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert rows["rl"]["ratio"] == rows["rl"]["tok_s"] / rows["bare"]["tok_s"]
    assert {"rl-fwd", "bare-fwd"} <= set(rows)  # each phase's forward-only pass


def test_a_section_needing_both_models_is_refused_at_once(tiny_model):
    out = benchmark("--model", tiny_model, "--cpu", "--resident", "one")  # default sections
    assert out.returncode == 2
    assert "--resident one" in out.stderr and "flex and dtype" in out.stderr
    assert "Traceback" not in out.stderr and "worker built" not in out.stdout
