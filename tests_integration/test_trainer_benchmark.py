"""The trainer benchmark (`benchmarks/trainer_vs_automodel.py`) in its CPU form: with one model
in memory at a time (`--resident one`, for an 80 GB GPU) the RL and bare steps still run on the
same tokens and their ratio is joined; a request it cannot serve is refused before anything
loads."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "trainer_vs_automodel.py"


def benchmark(*args: str) -> subprocess.CompletedProcess:
    with socket.socket() as s:  # the worker's process group (world of one) needs a port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_PORT": str(port)}
    command = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def test_one_model_at_a_time_joins_the_step_ratio(tiny_model, tmp_path):
    sizes = ["--seq-lens", "128", "--tokens-per-step", "256", "--max-tokens-per-microbatch", "256",
             "--trained-share", "0.25"]  # fmt: skip
    steps = ["--entropy-coefs", "0", "--warmup", "1", "--steps", "2"]
    where = ["--model", tiny_model, "--cpu", "--resident", "one", "--out", str(tmp_path)]
    out = benchmark(*where, "--sections", "main", *sizes, *steps)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RL model freed" in out.stdout
    pattern = r"\[128 entropy off\] step ratio ([\d.]+) \(rl ([\d.]+) s, bare ([\d.]+) s\)"
    line = re.search(pattern, out.stdout)
    assert line, out.stdout
    ratio, rl, bare = (float(x) for x in line.groups())
    # tokens/s over tokens/s: time inverted. Each printed value is rounded (the ratio to 0.01,
    # times to 1 ms); their rounding, propagated, is the slack.
    slack = 0.005 + bare / rl * (0.0005 / (rl - 0.0005) + 0.0005 / (bare - 0.0005))
    assert abs(ratio - bare / rl) <= slack, (ratio, rl, bare)
    rows = {r["variant"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert rows["rl"]["ratio"] == rows["rl"]["tok_s"] / rows["bare"]["tok_s"]
    assert {"rl-fwd", "bare-fwd"} <= set(rows)  # each phase's forward-only pass


def test_a_request_it_cannot_serve_is_refused_at_once(tiny_model):
    out = benchmark("--model", tiny_model, "--cpu", "--resident", "one", "--sections", "main,flex")
    assert out.returncode == 2
    assert "--sections" in out.stderr and "flex" in out.stderr
    assert "Traceback" not in out.stderr and "worker built" not in out.stdout
    out = benchmark("--model", tiny_model, "--cpu", "--trained-share", "1")
    assert out.returncode == 2 and "--trained-share 1" in out.stderr
    assert "Traceback" not in out.stderr and "worker built" not in out.stdout
