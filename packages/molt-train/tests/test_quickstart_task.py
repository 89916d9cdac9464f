"""The shipped quickstart task: its reward, its data, and both agent forms on a scripted engine."""

import asyncio
import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from molt_capture.testing import FakeGenerator, assert_token_exact
from molt_capture.tiny_tokenizer import build_tiny_tokenizer
from molt_rollout import ChatRunner, EnvRunner, RolloutConfig, load_agent
from molt_rollout.agents.data import load_rows
from molt_train import quickstart
from molt_train.quickstart import data_path, halves_chat, halves_env, make_data
from molt_train.quickstart.reward import HALVES, alphabet_half, reward

FIRST_ROW = {"prompt": [{"role": "user", "content": "abcdefghijklm"}], "label": "a-m"}
SECOND_ROW = {"prompt": [{"role": "user", "content": "nopqrstuvwxyz"}], "label": "n-z"}
# As the quickstart samples: one token per reply (the scripted "cat" is cut after one token).
CONFIG = dict(max_tokens=1, temperature=1.0)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return PreTrainedTokenizerFast.from_pretrained(
        build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    )


def run(runner, row, rollout_id="r0"):
    try:
        return asyncio.run(runner.run(row, rollout_id=rollout_id, group_id="g0"))
    finally:
        runner.close()


@pytest.mark.parametrize(
    "reply, half",
    [
        ("a", "a-m"),
        ("m", "a-m"),
        (" b", "a-m"),
        ("Ke", "a-m"),
        ("\n M", "a-m"),
        ("n", "n-z"),
        ("sist", "n-z"),
        ("Z", "n-z"),
        ("x marks it", "n-z"),
        ("", None),
        ("   ", None),
        ("7", None),
        ("?", None),
        ("<", None),
        ("é", None),
        ("\ufffd", None),
        ("\u212a", None),
        ("\u017f", None),
    ],
)
def test_alphabet_half_reads_the_first_non_whitespace_character(reply, half):
    assert alphabet_half(reply) == half


def test_reward_is_one_exactly_for_the_asked_half():
    assert reward("c", "a-m") == 1.0 and reward("Q", "n-z") == 1.0
    assert reward("c", "n-z") == 0.0 and reward("Q", "a-m") == 0.0
    assert reward("", "a-m") == 0.0 and reward("7", "n-z") == 0.0  # no letter earns nothing
    with pytest.raises(ValueError, match="expected one of"):
        reward("c", "letter")


def test_shipped_data_is_what_make_data_writes():
    for name, count, seed in (("halves_train.jsonl", 256, 0), ("halves_eval.jsonl", 50, 1)):
        path = data_path(name)
        assert path.parent == Path(quickstart.__file__).parent
        rows = load_rows(str(path))  # the loader's own checks pass
        assert rows == make_data.make_rows(count, seed)
        assert {r["data_source"] for r in rows} == {"halves"}
        assert sum(r["label"] == "a-m" for r in rows) == count // 2
        for r in rows:
            assert r["prompt"] == [{"role": "user", "content": HALVES[r["label"]]}]
    sft = [json.loads(line) for line in data_path("halves_sft.jsonl").read_text().splitlines()]
    assert sft == make_data.make_conversations(make_data.SFT_ROWS, seed=2)
    for row in sft:  # every answer is a letter of the half its prompt shows
        turns = row["messages"]
        for user, answer in zip(turns[::2], turns[1::2], strict=True):
            label = next(k for k, v in HALVES.items() if v == user["content"])
            assert reward(answer["content"], label) == 1.0


@pytest.mark.parametrize("spec", ["molt_train.quickstart.halves_env", halves_env.__file__])
def test_env_module_passes_the_contract_check(spec):
    runner = load_agent(spec)
    assert issubclass(runner, EnvRunner) and runner.env_class.__name__ == "HalfEnv"


@pytest.mark.parametrize("spec", ["molt_train.quickstart.halves_chat", halves_chat.__file__])
def test_chat_module_passes_the_contract_check(spec):
    runner = load_agent(spec)
    assert issubclass(runner, ChatRunner) and runner.agent_class.__name__ == "HalfAgent"


@pytest.mark.parametrize("row, expected", [(FIRST_ROW, 1.0), (SECOND_ROW, 0.0)])
def test_env_form_scores_a_scripted_reply(tokenizer, row, expected):
    gen = FakeGenerator(tokenizer, ["cat"])
    rollout = run(halves_env.AgentRunner(gen, tokenizer, RolloutConfig(**CONFIG)), row)
    assert (rollout.reward, rollout.score) == (expected, expected)
    (seg,) = rollout.segments
    assert tokenizer.decode(seg.token_ids[seg.turns[0].start :]) == "c"  # one token, as sampled
    assert_token_exact(rollout.segments, gen.calls)


@pytest.mark.parametrize("row, expected", [(FIRST_ROW, 1.0), (SECOND_ROW, 0.0)])
def test_chat_form_scores_a_scripted_reply(tokenizer, row, expected):
    gen = FakeGenerator(tokenizer, ["cat"])
    config = RolloutConfig(**CONFIG, generator_timeout_s=10)
    rollout = run(halves_chat.AgentRunner(gen, tokenizer, config), row)
    assert (rollout.reward, rollout.score) == (expected, expected)
    assert gen.calls[0].params.max_tokens == 1  # the agent passes ctx.max_tokens on
    assert_token_exact(rollout.segments, gen.calls)


def test_both_forms_send_the_engine_identical_prompt_tokens(tokenizer):
    env_gen, chat_gen = FakeGenerator(tokenizer, ["q"]), FakeGenerator(tokenizer, ["q"])
    run(halves_env.AgentRunner(env_gen, tokenizer, RolloutConfig(**CONFIG)), SECOND_ROW)
    config = RolloutConfig(**CONFIG, generator_timeout_s=10)
    run(halves_chat.AgentRunner(chat_gen, tokenizer, config), SECOND_ROW)
    assert env_gen.calls[0].token_ids == chat_gen.calls[0].token_ids
