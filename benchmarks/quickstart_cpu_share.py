"""CPU seconds per step of each process of a running `molt-train quickstart`.

    RAY_AUTH_MODE=disabled python benchmarks/quickstart_cpu_share.py [-- extra molt-train flags]

Starts the quickstart, reads the user + system CPU time of the driver and all its descendants
(Ray's processes, runner and policy actors, the engine's processes, the router) when step
`--from` has been logged and again at step `--to`, and prints each kind of process's CPU
seconds per step. On a saturated machine the total is close to cores × wall time: the table says
which process the step is waiting for.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

# Process kinds, by a marker in the command line or process name (first match wins).
KINDS = ["VLLM::Worker", "VLLM::EngineCore", "api_server", "RunnerActor", "ModelWorker",
         "EngineActor", "vllm::router", "raylet", "gcs_server", "molt_train.cli", "lifeline"]  # fmt: skip


def kind(process: psutil.Process) -> str:
    try:
        text = " ".join(process.cmdline()) + " " + process.name()
    except psutil.Error:
        return "?"
    return next((k for k in KINDS if k in text), process.name())


def cpu_by_pid(root: int) -> dict[int, tuple[str, float]]:
    out = {}
    parent = psutil.Process(root)
    for process in [parent, *parent.children(recursive=True)]:
        try:
            times = process.cpu_times()
            out[process.pid] = (kind(process), times.user + times.system)
        except psutil.Error:
            pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--from", dest="first", type=int, default=6)
    parser.add_argument("--to", dest="last", type=int, default=26)
    parser.add_argument("extra", nargs="*", help="molt-train flags (after --)")
    args = parser.parse_args()
    out_dir = Path(tempfile.mkdtemp(prefix="quickstart-cpu-"))
    cmd = [sys.executable, "-m", "molt_train.cli", "quickstart", "--train.num_steps",
           str(args.last + 2), "--eval.every_steps", "0", "--logger.wandb_mode", "disabled",
           "--ckpt.export_hf", "False", "--train.output_dir", str(out_dir),
           "--logger.run_name", "run", *args.extra]  # fmt: skip
    with open(out_dir / "run.log", "w") as log:
        driver = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, RAY_AUTH_MODE="disabled"))  # fmt: skip
    metrics = out_dir / "run" / "metrics.jsonl"

    def logged() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    while logged() < args.first:
        if driver.poll() is not None:
            raise SystemExit(f"the run ended early: {out_dir / 'run.log'}")
        time.sleep(0.05)
    before, t0 = cpu_by_pid(driver.pid), time.time()
    while logged() < args.last:
        time.sleep(0.05)
    after, t1 = cpu_by_pid(driver.pid), time.time()
    driver.wait()

    steps = args.last - args.first
    per_kind: dict[str, float] = collections.defaultdict(float)
    for pid, (name, seconds) in after.items():
        per_kind[name] += seconds - before.get(pid, (name, 0.0))[1]
    total = sum(per_kind.values())
    print(f"steps {args.first}..{args.last}: wall {(t1 - t0) / steps:.3f} s/step, "
          f"CPU {total / steps:.3f} s/step of {os.cpu_count()} cores")  # fmt: skip
    print("| process | CPU s / step | share |\n|---|---|---|")
    for name, seconds in sorted(per_kind.items(), key=lambda item: -item[1]):
        if seconds / steps >= 0.002:
            print(f"| {name} | {seconds / steps:.3f} | {100 * seconds / total:.0f}% |")


if __name__ == "__main__":
    main()
