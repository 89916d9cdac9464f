"""The shipped quickstart task: its reward, its data, and both agent forms on a scripted engine."""

import asyncio
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from molt_capture.testing import FakeGenerator, assert_token_exact, build_tiny_tokenizer
from molt_rollout import ChatRunner, EnvRunner, RunnerConfig, load_agent
from molt_rollout.data import load_rows
from molt_train import quickstart
from molt_train.quickstart import data_path, digits_chat, digits_env, make_data
from molt_train.quickstart.reward import character_kind, reward

DIGIT_ROW = {"prompt": [{"role": "user", "content": "0123456789"}], "label": "digit"}
LETTER_ROW = {"prompt": [{"role": "user", "content": "abcdefghij"}], "label": "letter"}
# As the quickstart samples: one token per reply (the scripted "7" is cut after one token).
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
    "reply, kind",
    [("7", "digit"), (" 4", "digit"), ("00", "digit"), ("7 is my answer", "digit"),
     ("a", "letter"), ("sist", "letter"), ("\n Q", "letter"),
     ("", None), ("   ", None), ("?", None), ("<", None), ("é", None), ("\ufffd", None)],
)  # fmt: skip
def test_character_kind_reads_the_first_non_whitespace_character(reply, kind):
    assert character_kind(reply) == kind


def test_reward_is_one_exactly_for_the_asked_kind():
    assert reward("7", "digit") == 1.0 and reward("x", "letter") == 1.0
    assert reward("7", "letter") == 0.0 and reward("x", "digit") == 0.0
    assert reward("", "digit") == 0.0 and reward("!", "letter") == 0.0  # garbage earns nothing
    with pytest.raises(ValueError, match="expected one of"):
        reward("7", "7")


def test_shipped_data_is_what_make_data_writes():
    for name, count, seed in (("digits_train.jsonl", 256, 0), ("digits_eval.jsonl", 50, 1)):
        path = data_path(name)
        assert path.parent == Path(quickstart.__file__).parent
        rows = load_rows(str(path))  # the loader's own checks pass
        assert [r["prompt"] for r in rows] == [
            r["prompt"] for r in make_data.make_rows(count, seed)
        ]
        assert {r["data_source"] for r in rows} == {"digits"}
        assert sum(r["label"] == "digit" for r in rows) == count // 2
        for r in rows:
            assert r["prompt"] == [{"role": "user", "content": make_data.PROMPTS[r["label"]]}]


@pytest.mark.parametrize("spec", ["molt_train.quickstart.digits_env", digits_env.__file__])
def test_env_module_passes_the_contract_check(spec):
    runner = load_agent(spec)
    assert issubclass(runner, EnvRunner) and runner.env_class.__name__ == "DigitEnv"


@pytest.mark.parametrize("spec", ["molt_train.quickstart.digits_chat", digits_chat.__file__])
def test_chat_module_passes_the_contract_check(spec):
    runner = load_agent(spec)
    assert issubclass(runner, ChatRunner) and runner.agent_class.__name__ == "DigitAgent"


@pytest.mark.parametrize("row, expected", [(DIGIT_ROW, 1.0), (LETTER_ROW, 0.0)])
def test_env_form_scores_a_scripted_reply(tokenizer, row, expected):
    gen = FakeGenerator(tokenizer, ["7"])
    rollout = run(digits_env.AgentRunner(gen, tokenizer, RunnerConfig(**CONFIG)), row)
    assert (rollout.reward, rollout.score) == (expected, expected)
    (seg,) = rollout.segments
    assert tokenizer.decode(seg.token_ids[seg.turns[0].start :]) == "7"  # one token, as sampled
    assert_token_exact(rollout.segments, gen.calls)


@pytest.mark.parametrize("row, expected", [(DIGIT_ROW, 1.0), (LETTER_ROW, 0.0)])
def test_chat_form_scores_a_scripted_reply(tokenizer, row, expected):
    gen = FakeGenerator(tokenizer, ["7"])
    config = RunnerConfig(**CONFIG, generator_timeout_s=10)
    rollout = run(digits_chat.AgentRunner(gen, tokenizer, config), row)
    assert (rollout.reward, rollout.score) == (expected, expected)
    assert gen.calls[0].params.max_tokens == 1  # the agent passes ctx.max_tokens on
    assert_token_exact(rollout.segments, gen.calls)


def test_both_forms_send_the_engine_identical_prompt_tokens(tokenizer):
    env_gen, chat_gen = FakeGenerator(tokenizer, ["q"]), FakeGenerator(tokenizer, ["q"])
    run(digits_env.AgentRunner(env_gen, tokenizer, RunnerConfig(**CONFIG)), LETTER_ROW)
    config = RunnerConfig(**CONFIG, generator_timeout_s=10)
    run(digits_chat.AgentRunner(chat_gen, tokenizer, config), LETTER_ROW)
    assert env_gen.calls[0].token_ids == chat_gen.calls[0].token_ids
