"""The quickstart's speed against the single-process baseline, side by side in one run.

    python benchmarks/quickstart_speed.py --steps 20 [--rounds 2] [--out DIR] \
        [-- extra molt-train flags]

Each round runs `molt-train quickstart` (engine, router, runners, the policy actor, a refit
every step) for `--steps` steps without evaluation, then benchmarks/quickstart_task_prototype.py
(the same algorithm in one process: HF sampling, plain torch) for the same steps, alternating,
so that drift in a shared machine's speed hits both. Reported per command, as the median over
rounds: start-up (process launch to the first step's start: for molt-train engine, router,
runners, the actor and the first version handshake), the median step (steps 2..N; step 1
waits for the first batch) and the first step's time; and molt-train's median per-phase times
(`timing/*`, docs/logging.md). Ratios are molt-train / prototype. Both commands' logs and
molt-train's run directories go to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROTOTYPE = Path(__file__).resolve().parent / "quickstart_task_prototype.py"
PHASES = [
    "timing/generation",
    "timing/experience",
    "timing/policy_train",
    "timing/broadcast",
    "timing/refit_transfer",
    "timing/step_total",
]


def run_molt(steps: int, extra: list[str], out_dir: Path) -> dict:
    name = f"speed-{time.strftime('%H%M%S')}"
    flags = f"--train.num_steps {steps} --eval.every_steps 0 --logger.wandb_mode disabled "
    flags += f"--ckpt.export_hf False --logger.run_name {name}"
    cmd = [sys.executable, "-m", "molt_train.cli", "quickstart", *flags.split()]
    cmd += ["--train.output_dir", str(out_dir), *extra]
    launched = time.time()
    with open(out_dir / f"{name}.log", "w") as log:
        env = dict(os.environ, RAY_AUTH_MODE="disabled")
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, env=env)
    wall = time.time() - launched
    rows = [json.loads(line) for line in (out_dir / name / "metrics.jsonl").open()]
    # A row's "time" is stamped when it is logged, right after its step's refit.
    first_start = rows[0]["time"] - rows[0]["timing/step_total"]
    result = {
        "startup_s": first_start - launched,
        "first_step_s": rows[0]["timing/step_total"],
        "median_step_s": statistics.median(r["timing/step_total"] for r in rows[1:]),
        "wall_s": wall,
    }
    for key in PHASES:
        result[key] = statistics.median(r[key] for r in rows[1:] if r.get(key) is not None)
    return result


def run_prototype(steps: int, out_dir: Path) -> dict:
    cmd = [sys.executable, str(PROTOTYPE), "--lag", "1", "--steps", str(steps), "--eval-every", "0"]
    launched = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    wall = time.time() - launched
    (out_dir / f"prototype-{time.strftime('%H%M%S')}.log").write_text(out)
    first_start = float(re.search(r"first_step_at (\S+)", out).group(1))
    step_s = [float(v) for v in re.findall(r"step_s (\S+)", out)]
    return {
        "startup_s": first_start - launched,
        "first_step_s": step_s[0],
        "median_step_s": statistics.median(step_s[1:]),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, help="logs and runs (default: a new temporary dir)")
    parser.add_argument("extra", nargs="*", help="molt-train flags (after --)")
    args = parser.parse_args()
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="quickstart-speed-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    molt, proto = [], []
    for _ in range(args.rounds):
        molt.append(run_molt(args.steps, args.extra, out_dir))
        proto.append(run_prototype(args.steps, out_dir))

    def med(results: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in results)

    print(f"{args.steps} steps, {args.rounds} round(s), logs in {out_dir}")
    print("| | molt-train quickstart | one-process prototype | ratio |")
    print("|---|---|---|---|")
    for key in ("startup_s", "median_step_s", "first_step_s", "wall_s"):
        a, b = med(molt, key), med(proto, key)
        print(f"| {key} | {a:.3f} | {b:.3f} | {a / b:.2f} |")
    print("\nmolt-train phases, median over steps 2..N (s):")
    print(" | ".join(f"{key} {med(molt, key):.3f}" for key in PHASES))


if __name__ == "__main__":
    main()
