"""molt_examples.verifiers_env: verifiers environments trained as they are.

verifiers 0.4.0 pins openai<3 and mcp==2.0.0, so these tests run in an environment of their own
(docs/environments/verifiers_env.md says how to build it) and are skipped elsewhere.

Two environments made here, with data built in code (no hub): a single-turn taskset (reverse a
word, a `datasets.Dataset`) and a multi-turn one (guess a number; the env answers "higher" or
"lower" between turns). verifiers loads a taskset by module name, so each is registered as a
module when this file is imported. This file is also the agent module of the molt-train run
below (`AgentRunner` records every engine call and checks each rollout against them).
"""

import asyncio
import importlib.machinery
import json
import re
import sys
import types
from difflib import SequenceMatcher

import pytest

vf = pytest.importorskip("verifiers.v1")

from recorded import RecordedChat, metrics, molt_train, note_session, read_traces  # noqa: E402

from molt_capture.testing import FakeGenerator, assert_token_exact  # noqa: E402
from molt_capture.types import Rollout  # noqa: E402
from molt_examples import verifiers_env  # noqa: E402
from molt_rollout import RolloutConfig  # noqa: E402

WORDS = ["molt", "verifier", "policy", "reward", "token", "engine", "router", "gradient"]


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def similarity(self, trace: vf.Trace) -> float:
        return SequenceMatcher(None, (trace.last_reply or "").strip(), self.data.answer).ratio()


class ReverseTaskset(vf.Taskset[ReverseTask, vf.TasksetConfig]):
    def load(self) -> list[ReverseTask]:
        from datasets import Dataset

        rows = Dataset.from_dict({"word": WORDS})
        system = "Reverse the word, letter by letter. Reply with the reversed word only."
        return [
            ReverseTask(
                ReverseData(
                    idx=i, prompt=row["word"], system_prompt=system, answer=row["word"][::-1]
                ),
                self.config.task,
            )  # fmt: skip
            for i, row in enumerate(rows)
        ]


class GuessData(vf.TaskData):
    answer: int


class GuessTask(vf.Task[GuessData]):
    @vf.reward(weight=1.0)
    async def guessed(self, trace: vf.Trace) -> float:
        return float(guess(trace.last_reply) == self.data.answer)


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self) -> list[GuessTask]:
        prompt = "I chose a number from 1 to 10. Guess it: reply with one number."
        return [GuessTask(GuessData(idx=i, prompt=prompt, answer=n), self.config.task)
                for i, n in enumerate([3, 7, 5, 9])]  # fmt: skip


class GuessEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    """Multi-turn: after each wrong guess the env answers as the user, three guesses at most."""

    async def run(self, task: vf.Task, agents) -> None:
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(2):
                value = guess(segment.last_reply)
                if value == task.data.answer:
                    return
                hint = "higher" if value is None or value < task.data.answer else "lower"
                segment = await chat.turn(f"No, {hint}.")


def guess(reply: str | None) -> int | None:
    numbers = re.findall(r"-?\d+", reply or "")
    return int(numbers[-1]) if numbers else None


def as_plugin(name: str, *exports: type) -> None:
    """A module named `name` exporting `exports`: what `--env.taskset.id name` imports."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__all__ = [cls.__name__ for cls in exports]
    for cls in exports:
        setattr(module, cls.__name__, cls)
    sys.modules[name] = module


as_plugin("molt_vf_reverse", ReverseTaskset)
as_plugin("molt_vf_guess", GuessTaskset, GuessEnv)
NULL = {"agent": {"harness": {"id": "null"}}}  # verifiers' plain chat loop, no tools
REVERSE = verifiers_env.env_config("molt_vf_reverse", NULL)
GUESS = verifiers_env.env_config("molt_vf_guess", NULL)


def test_rows_carry_the_env_and_the_task():
    rows = verifiers_env.make_rows(REVERSE, num_tasks=3)
    assert [r["verifiers"]["task"]["answer"] for r in rows] == ["tlom", "reifirev", "ycilop"]
    assert rows[0]["prompt"][1] == {"role": "user", "content": "molt"}
    assert rows[0]["data_source"] == "molt_vf_reverse"
    assert rows[0]["verifiers"]["env"]["agent"]["runtime"]["type"] == "subprocess"
    [row] = verifiers_env.make_rows(GUESS, num_tasks=1)
    assert verifiers_env.load_env(row["verifiers"]["env"]).__class__ is GuessEnv


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    from molt_capture.tiny_tokenizer import build_tiny_tokenizer

    return PreTrainedTokenizerFast.from_pretrained(
        str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))
    )


def run_scripted(tokenizer, row, replies):
    generator = FakeGenerator(tokenizer, replies)
    runner = verifiers_env.AgentRunner(generator, tokenizer, RolloutConfig(max_len=4096))
    try:
        rollout = asyncio.run(runner.run(row, "r0", "g0"))
    finally:
        runner.close()
    assert isinstance(rollout, Rollout), rollout
    assert_token_exact(rollout.segments, generator.calls)
    return rollout, [tokenizer.decode(c.token_ids) for c in generator.calls]


def test_a_single_turn_episode_is_scored_by_the_rubric(tokenizer):
    row = verifiers_env.make_rows(REVERSE, num_tasks=1)[0]
    rollout, prompts = run_scripted(tokenizer, row, ["tlom"])
    assert rollout.reward == 1.0 and rollout.info["reward_similarity"] == 1.0
    assert prompts[0].endswith("<|im_start|>user\nmolt<|im_end|>\n<|im_start|>assistant\n")


def test_a_multi_turn_episode_is_one_token_exact_segment(tokenizer):
    row = verifiers_env.make_rows(GUESS, num_tasks=2)[1]  # the answer is 7
    rollout, prompts = run_scripted(tokenizer, row, ["5", "8", "7"])
    assert rollout.reward == 1.0 and rollout.info["episode_turns"] == 3.0
    assert "No, higher." in prompts[1] and "No, lower." in prompts[2]
    assert len(rollout.segments) == 1  # each turn extends the recorded trace


# --- the agent module of the molt-train run below ---------------------------------------------


class TracedAgent(verifiers_env.VerifiersAgent):
    async def run(self, ctx):
        note_session(ctx)
        return await super().run(ctx)


class AgentRunner(RecordedChat, verifiers_env.AgentRunner):
    """The run's agent (this file): every engine call recorded."""

    agent_class = TracedAgent

    def traced(self, row: dict) -> dict:
        return {"env": row["data_source"]}


def test_molt_train_runs_a_single_and_a_multi_turn_env(tmp_path):
    rows = tmp_path / "rows.jsonl"
    made = verifiers_env.make_rows(REVERSE, 4) + verifiers_env.make_rows(GUESS, 4)
    mixed = [
        row | {"trace_dir": str(tmp_path)}
        for pair in zip(made[:4], made[4:], strict=True)
        for row in pair
    ]
    rows.write_text("".join(json.dumps(row) + "\n" for row in mixed))
    run = tmp_path / "run"
    flags = ["quickstart", "--logger.wandb_mode", "disabled", "--ckpt.export_hf", "False",
             "--eval.every_steps", "0", "--train.agent_path", __file__,
             "--data.train_files", str(rows), "--data.eval_files", str(rows),
             "--data.shuffle", "False", "--train.num_steps", "2",
             "--rollout.groups_per_batch", "2", "--rollout.n_samples_per_prompt", "2",
             "--rollout.max_tokens", "16", "--rollout.num_runners", "1"]  # fmt: skip
    molt_train(run, *flags)

    steps = metrics(run)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert 0.0 <= s["rollout/reward_mean"] <= 1.0
        assert {"loss/policy", "timing/step_total", "rollout/info/episode_turns"} <= s.keys()
    records = read_traces(tmp_path)
    assert len(records) >= 8 and {r["env"] for r in records} == {"molt_vf_reverse", "molt_vf_guess"}
    for r in records:
        assert r["dropped"] is None and r["exact"] is True, r
        assert r["trained"] == r["generated"] and 0.0 <= r["reward"] <= 1.0
        rubric = "reward_similarity" if r["env"] == "molt_vf_reverse" else "reward_guessed"
        assert r["info"][rubric] == r["reward"]  # the rubric's score is the reward
    turns = [r["info"]["episode_turns"] for r in records if r["env"] == "molt_vf_guess"]
    assert turns and all(1 <= t <= 3 for t in turns)
