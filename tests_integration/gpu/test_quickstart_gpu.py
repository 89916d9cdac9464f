"""`molt-train quickstart` on one GPU, engine and policy colocated: reward rises as on CPU."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

COLOCATED = ["--train.colocate", "--actor.num_workers", "1", "--vllm.dtype", "bfloat16",
             "--vllm.enforce_eager", "--vllm.startup_timeout_s", "400", "--logger.wandb_mode", "disabled"]  # fmt: skip


def quickstart(tmp_path, *flags: str) -> list[dict]:
    cmd = [sys.executable, "-m", "molt_train.cli", "quickstart", *COLOCATED, *flags,
           "--train.output_dir", str(tmp_path), "--logger.run_name", "gpu"]  # fmt: skip
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return [json.loads(line) for line in (tmp_path / "gpu" / "metrics.jsonl").open()]


def test_quickstart_learns_colocated(tmp_path):
    rows = quickstart(tmp_path, "--train.num_steps", "20", "--eval.every_steps", "10")
    rewards = [r["rollout/reward_mean"] for r in rows]
    print("rewards:", [round(r, 3) for r in rewards])
    print("step s:", [round(r["timing/step_total"], 3) for r in rows])
    print("refit s:", [round(r["timing/refit_total"], 4) for r in rows])
    assert rewards[0] < 0.4 and sum(rewards[-3:]) / 3 > 0.75, rewards


def test_sleep_mode_frees_the_engine_for_the_optimizer_step(tmp_path):
    rows = quickstart(tmp_path, "--vllm.enable_sleep_mode", "--train.partial_rollout_enable",
                      "False", "--train.num_steps", "3", "--eval.every_steps", "0")  # fmt: skip
    assert [r["step"] for r in rows] == [1, 2, 3]
    print("sleep mode step s:", [round(r["timing/step_total"], 3) for r in rows])


def test_two_engines_share_the_gpu(tmp_path):
    """--vllm.engines_per_gpu 2 colocated: both engines on the trainer's GPU, started one after
    the other, both serve rollouts and take every refit (over the one shared staging buffer)."""
    rows = quickstart(tmp_path, "--vllm.num_engines", "2", "--vllm.engines_per_gpu", "2",
                      "--train.num_steps", "3", "--eval.every_steps", "0")  # fmt: skip
    assert [r["step"] for r in rows] == [1, 2, 3]
    print("two engines: refit s", [round(r["timing/refit_total"], 4) for r in rows],
          "vllm_kl", [r["is/vllm_kl"] for r in rows])  # fmt: skip
    kls = [r["is/vllm_kl"] for r in rows if r["is/vllm_kl"] is not None]  # None: no token at
    assert kls and all(abs(kl) < 1e-2 for kl in kls), rows  # the step's version; refit reached both
    logs = [(tmp_path / "gpu" / "logs" / f"engine_{i}.log").read_text() for i in (0, 1)]
    for log in logs:
        assert log.count("POST /inference/v1/generate") > 10
        assert "--gpu-memory-utilization 0.225" in log  # colocated's 0.45, halved
