"""The Env runner with the fake generator: token exactness, observations, budgets, failures."""

from __future__ import annotations

import asyncio
import time

import pytest
from transformers import PreTrainedTokenizerFast

from molt_capture import ChatRenderer
from molt_capture.testing import (
    ADD_TOOL,
    FakeGenerator,
    assert_token_exact,
    routing_row,
    tool_call_text,
)
from molt_capture.tiny_tokenizer import build_tiny_tokenizer
from molt_capture.types import PROMPT_VERSION, derive_seed
from molt_rollout.agents.agent import (
    Dropped,
    Env,
    EnvState,
    Result,
    RolloutDropped,
    row_messages,
)
from molt_rollout.agents.env_runner import EnvRunner
from molt_rollout.config import RolloutConfig

ROW = {
    "prompt": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1+2?"},
    ],
    "tools": [ADD_TOOL],
    "label": "3",
}
CALL = "<think>\nI should add.\n</think>\n\nLet me add.\n" + tool_call_text("add", {"a": 1, "b": 2})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return PreTrainedTokenizerFast.from_pretrained(
        build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    )


def make_runner(tokenizer, env_class, replies, apply_chat_template=True, **config):
    class Runner(EnvRunner):
        pass

    Runner.env_class = env_class
    gen = FakeGenerator(tokenizer, replies)
    return Runner(gen, tokenizer, RolloutConfig(**config), apply_chat_template), gen


def run(runner, row=ROW, rollout_id="r0"):
    return asyncio.run(runner.run(row, rollout_id=rollout_id, group_id="g0"))


class ExactAnswer(Env):
    async def step(self, state: EnvState) -> Result:
        correct = state.reply.content.strip().endswith(state.label + ".")
        return Result(reward=float(correct), score=float(correct), info={"chars": len(state.text)})


class Calculator(Env):
    """Answers `add` tool calls with their sum; rewards the final answer."""

    async def reset(self, state: EnvState) -> None:
        state.data["calls"] = 0

    async def step(self, state: EnvState) -> Result:
        if state.reply.tool_calls:
            state.data["calls"] += 1
            args = state.reply.tool_calls[0].arguments
            result = {"role": "tool", "content": str(args["a"] + args["b"])}
            return Result(reward=0.1, observation=[result], terminated=False)
        return Result(reward=1.0 if "3" in state.reply.content else 0.0)


class Forever(Env):
    """Never finishes: every reply gets a text observation."""

    async def step(self, state: EnvState) -> Result:
        return Result(reward=1.0, observation=" more", terminated=False)


def test_single_turn_prompt_rendered_once_and_trace_exact(tokenizer):
    runner, gen = make_runner(tokenizer, ExactAnswer, ["The answer is 3."])
    rollout = run(runner)
    (seg,) = rollout.segments
    assert_token_exact(rollout.segments, gen.calls)
    renderer = ChatRenderer(tokenizer)
    expected = renderer.encode(renderer.render(ROW["prompt"], ROW["tools"], True))
    assert gen.calls[0].token_ids == expected  # system turn and tool schema in the prompt
    assert gen.calls[0].session_id == "r0"  # router affinity by rollout id
    assert (rollout.reward, rollout.score) == (1.0, 1.0)
    assert (rollout.rollout_id, rollout.group_id) == ("r0", "g0")
    assert rollout.info["reward_turn_0"] == 1.0 and rollout.info["turns"] == 1.0
    assert rollout.info["chars"] == len("The answer is 3.") and rollout.info["truncated"] == 0.0
    assert not seg.truncated and seg.temperature == 1.0
    assert set(rollout.timings) == {"generate", "env", "total"}


def test_multi_turn_tool_observations_are_masked_context(tokenizer):
    runner, gen = make_runner(tokenizer, Calculator, [CALL, "The answer is 3."])
    rollout = run(runner)
    (seg,) = rollout.segments
    assert_token_exact(rollout.segments, gen.calls)  # trained ids == generated ids
    assert rollout.reward == pytest.approx(1.1)  # per-turn rewards summed
    assert rollout.info["reward_turn_0"] == 0.1 and rollout.info["reward_turn_1"] == 1.0
    first, second = seg.turns
    observation = slice(first.end, second.start)
    assert seg.trainable[observation] == [0] * (second.start - first.end)
    assert set(seg.weight_versions[observation]) == {PROMPT_VERSION}
    assert set(seg.logprobs[observation]) == {0.0}
    # The observation reads as the chat template renders a tool turn after the reply.
    between = tokenizer.decode(seg.token_ids[observation])
    assert between == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_seeded_runner_seeds_each_turn_of_each_rollout(tokenizer):
    """--rollout.seed: a function of (seed, rollout id, turn), so a rerun samples the same."""
    seeded, gen = make_runner(tokenizer, Calculator, [CALL, "The answer is 3."], seed=5)
    run(seeded, rollout_id="p2-1")
    assert [c.params.seed for c in gen.calls] == [derive_seed(5, "p2-1", t) for t in (0, 1)]
    unseeded, gen = make_runner(tokenizer, Calculator, [CALL, "The answer is 3."])
    run(unseeded)
    assert [c.params.seed for c in gen.calls] == [None, None]


def test_routing_rows_cover_every_position_the_engine_ran(tokenizer):
    runner, gen = make_runner(tokenizer, Calculator, [CALL, "The answer is 3."])
    gen.routing = True
    (seg,) = run(runner).segments
    last = seg.turns[-1].end - 1  # the last sampled token: never run through the model
    assert seg.routed_experts == [routing_row(p) for p in range(last)] + [None] * (len(seg) - last)
    # The second turn asked only for what the first did not report: its last sampled token
    # and the observation after it.
    assert [c.params.routing_start for c in gen.calls] == [0, seg.turns[0].end - 1]


def test_env_state_follows_the_conversation(tokenizer):
    seen = []

    class Recorder(Calculator):
        async def step(self, state):
            seen.append(
                (
                    state.turn,
                    state.finish_reason,
                    [m["role"] for m in state.messages],
                    state.rollout_id,
                    state.group_id,
                )
            )
            return await super().step(state)

    runner, _ = make_runner(tokenizer, Recorder, [CALL, "The answer is 3."])
    rollout = run(runner)
    assert seen == [
        (0, "stop", ["system", "user", "assistant"], "r0", "g0"),
        (1, "stop", ["system", "user", "assistant", "tool", "assistant"], "r0", "g0"),
    ]
    assert rollout.reward == pytest.approx(1.1)


def test_text_observation_without_chat_template(tokenizer):
    runner, gen = make_runner(tokenizer, Forever, ["abc"], apply_chat_template=False, max_turns=3)
    rollout = run(runner, row={"prompt": "Count:"})
    (seg,) = rollout.segments
    assert_token_exact(rollout.segments, gen.calls)
    assert gen.calls[0].token_ids == tokenizer.encode("Count:")
    first, second, _ = seg.turns
    assert seg.token_ids[first.end : second.start] == tokenizer.encode(
        " more", add_special_tokens=False
    )  # tokenized on its own
    assert rollout.info["turns"] == 3.0 and rollout.info["truncated"] == 1.0 and seg.truncated
    assert rollout.reward == 3.0


def test_max_turns_truncates(tokenizer):
    runner, gen = make_runner(tokenizer, Forever, ["Hi."], max_turns=2)
    rollout = run(runner)
    assert len(gen.calls) == 2 and rollout.info["truncated"] == 1.0
    assert rollout.segments[0].truncated


def test_rollout_token_budget(tokenizer):
    runner, gen = make_runner(tokenizer, Forever, ["0123456789"], max_response_tokens=25)
    rollout = run(runner)
    assert_token_exact(rollout.segments, gen.calls)
    assert sum(len(c.generation.token_ids) for c in gen.calls) == 25
    assert [c.params.max_tokens for c in gen.calls] == [25, 14, 3]
    assert rollout.info["truncated"] == 1.0


def test_context_budget_and_per_turn_default(tokenizer):
    row = {"prompt": "Hi"}
    prompt_len = len(
        ChatRenderer(tokenizer).encode(
            ChatRenderer(tokenizer).render(row_messages(row), None, True)
        )
    )
    max_len = prompt_len + 20
    runner, gen = make_runner(tokenizer, Forever, ["0123456789"], max_tokens=4, max_len=max_len)
    rollout = run(runner, row=row)
    (seg,) = rollout.segments
    assert_token_exact(rollout.segments, gen.calls)
    assert [c.params.max_tokens for c in gen.calls][0] == 4
    assert all(c.params.max_tokens <= 4 for c in gen.calls)
    assert len(seg) <= max_len and seg.truncated


def test_prompt_too_long_is_dropped(tokenizer):
    runner, gen = make_runner(tokenizer, Forever, ["x"], max_len=10)
    dropped = run(runner)
    assert isinstance(dropped, Dropped) and dropped.reason == "prompt_too_long"
    assert not gen.calls


def test_per_turn_overrides_apply_to_the_next_turn_only(tokenizer):
    class Overrides(Env):
        async def step(self, state):
            if state.turn == 0:
                return Result(0.0, observation=" go", terminated=False, max_tokens=3, stop=["!"])
            if state.turn == 1:
                return Result(0.0, observation=" hot", terminated=False, temperature=0.5)
            return Result(1.0)

    runner, gen = make_runner(tokenizer, Overrides, ["Hello there!"], max_tokens=50)
    rollout = run(runner)
    params = [c.params for c in gen.calls]
    assert [p.max_tokens for p in params] == [50, 3, 50]
    assert [p.stop for p in params] == [[], ["!"], []]
    assert [p.temperature for p in params] == [1.0, 1.0, 0.5]
    # A new temperature opens a new segment whose context is the exact trace so far.
    first, second = rollout.segments
    assert (first.temperature, second.temperature) == (1.0, 0.5)
    assert second.token_ids[: len(first)] == first.token_ids
    assert second.trainable[: len(first)] == [0] * len(first)
    assert_token_exact(rollout.segments, gen.calls)


def test_last_reward_instead_of_sum(tokenizer):
    class LastReward(EnvRunner):
        env_class = Forever

        def combine_rewards(self, rewards):
            return rewards[-1] * 10

    gen = FakeGenerator(tokenizer, ["Hi."])
    rollout = run(LastReward(gen, tokenizer, RolloutConfig(max_turns=3)))
    assert rollout.reward == 10.0


def test_env_exception_is_dropped_with_reason(tokenizer):
    class Broken(Env):
        async def step(self, state):
            raise KeyError("no such tool")

    dropped = run(make_runner(tokenizer, Broken, ["Hi."])[0])
    assert isinstance(dropped, Dropped) and dropped.reason == "agent_error"
    assert "KeyError: 'no such tool'" in dropped.detail and "in step" in dropped.detail
    assert (dropped.rollout_id, dropped.group_id) == ("r0", "g0")


def test_env_constructor_failure_is_dropped(tokenizer):
    class NeedsConfig(Env):
        def __init__(self):
            raise FileNotFoundError("config.yaml")

    dropped = run(make_runner(tokenizer, NeedsConfig, ["Hi."])[0])
    assert dropped.reason == "agent_error" and "FileNotFoundError" in dropped.detail


def test_generator_failure_and_bad_result(tokenizer):
    runner, gen = make_runner(tokenizer, ExactAnswer, ["Hi."])
    gen.fail_next = ConnectionError("engine gone")
    dropped = run(runner)
    assert dropped.reason == "engine_error" and "engine gone" in dropped.detail

    class NoResult(Env):
        async def step(self, state):
            return 1.0

    class NanReward(Env):
        async def step(self, state):
            return Result(reward=float("nan"))

    for env in (NoResult, NanReward):
        dropped = run(make_runner(tokenizer, env, ["Hi."])[0])
        assert dropped.reason == "bad_result", dropped


def test_deadline_drops_a_slow_rollout(tokenizer):
    class Stubborn(Env):
        """Ignores the first cancellation: the runner must return anyway."""

        async def step(self, state):
            for _ in range(2):
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    continue
            return Result(1.0)

    # Waited for, the Env would take 30 s more after the cancellation it ignores.
    runner, _ = make_runner(tokenizer, Stubborn, ["Hi."], deadline_s=0.3)
    t = time.monotonic()
    dropped = run(runner)
    assert dropped.reason == "deadline" and time.monotonic() - t < 10
    assert 0.3 <= dropped.elapsed_s < 10

    runner, gen = make_runner(tokenizer, ExactAnswer, ["Hi."], deadline_s=0.2)
    gen.delay_s = 30  # a stuck engine call is cancelled too
    t = time.monotonic()
    assert run(runner).reason == "deadline" and time.monotonic() - t < 10


def test_group_runs_concurrently(tokenizer):
    runner, gen = make_runner(tokenizer, ExactAnswer, ["The answer is 3."])
    gen.hold_until_concurrent(8)  # the engine answers once all 8 rollouts are asking

    async def group():
        return await asyncio.gather(
            *(runner.run(ROW, rollout_id=f"r{i}", group_id="g") for i in range(8))
        )

    rollouts = asyncio.run(group())
    assert gen.peak == 8 and [r.reward for r in rollouts] == [1.0] * 8
    assert sorted(r.rollout_id for r in rollouts) == [f"r{i}" for i in range(8)]
    assert {c.session_id for c in gen.calls} == {f"r{i}" for i in range(8)}


def test_env_can_drop_on_purpose(tokenizer):
    class Sandboxed(Env):
        async def reset(self, state):
            raise RolloutDropped("sandbox", "container did not start")

    runner, gen = make_runner(tokenizer, Sandboxed, ["Hi."])
    dropped = run(runner)
    assert (dropped.reason, dropped.detail) == ("sandbox", "container did not start")
    assert not gen.calls


def test_with_sampling_changes_only_the_sampling(tokenizer):
    runner, gen = make_runner(tokenizer, ExactAnswer, ["The answer is 3."], temperature=1.0)
    sibling = runner.with_sampling(RolloutConfig(temperature=0.25, max_tokens=7))
    run(sibling)
    run(runner)
    eval_call, train_call = gen.calls
    assert (eval_call.params.temperature, eval_call.params.max_tokens) == (0.25, 7)
    assert train_call.params.temperature == 1.0 and runner.config.temperature == 1.0
    assert sibling.generator is runner.generator and eval_call.token_ids == train_call.token_ids
