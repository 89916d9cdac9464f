"""The shipped image task on one GPU, engine and policy colocated: the tiny VLM learns to read
the image through vLLM CUDA, and engine and trainer agree on image prompts in bf16."""

import pytest
from test_quickstart_gpu import quickstart

from molt_train.quickstart.colours import write_data

pytestmark = pytest.mark.gpu


def test_the_tiny_vlm_learns_colocated(tmp_path):
    from molt_rollout.engines.tiny_vlm import build_tiny_vlm

    model, data = build_tiny_vlm(tmp_path / "tiny-idefics3"), write_data(tmp_path / "data")
    # On-policy, so every step's 128 tokens are at version match: asynchronously a step can hold
    # a single matched token, and a one-token vllm_kl is not a measurement (2.9e-3 on 2026-12-03).
    rows = quickstart(tmp_path, "--actor.model_path", str(model), "--data.train_files", str(data),
                      "--train.agent_path", "molt_train.quickstart.colours_env",
                      "--train.force_on_policy", "--train.num_steps", "20",
                      "--eval.every_steps", "0")  # fmt: skip
    rewards = [r["rollout/reward_mean"] for r in rows]
    kl = [r["is/vllm_kl"] for r in rows]
    print("vlm rewards:", [round(r, 2) for r in rewards], "vllm_kl:", kl)
    print("vlm step s:", [round(r["timing/step_total"], 3) for r in rows])
    assert sum(rewards[-3:]) / 3 > 0.75, rewards  # a prompt-blind policy earns 0.5
    assert all(k is not None and abs(k) < 1e-3 for k in kl), kl  # bf16 engine against bf16 autocast
