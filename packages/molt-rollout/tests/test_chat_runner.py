"""The chat runner with stock openai / anthropic SDK agents against its own capture server."""

from __future__ import annotations

import asyncio
import copy
import json
import time

import anthropic
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from molt_capture.testing import ADD_TOOL, FakeGenerator, assert_token_exact, tool_call_text
from molt_capture.tiny_tokenizer import build_tiny_tokenizer
from molt_capture.types import Rollout, derive_seed
from molt_rollout.agents.agent import (
    ChatAgent,
    ChatContext,
    Dropped,
    Env,
    Result,
    RolloutDropped,
)
from molt_rollout.agents.chat_runner import ChatRunner
from molt_rollout.agents.env_runner import EnvRunner
from molt_rollout.config import RolloutConfig

# Tool schema keys deliberately out of the wire order: both forms must still agree.
TOOL = {
    "type": "function",
    "function": {
        "parameters": ADD_TOOL["function"]["parameters"],
        "name": "add",
        "description": "Add two integers.",
    },
}
ROW = {
    "prompt": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1+2?"},
    ],
    "tools": [TOOL],
    "label": "3",
}
CALL = "<think>\nI should add.\n</think>\n\nLet me add.\n" + tool_call_text("add", {"a": 1, "b": 2})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return PreTrainedTokenizerFast.from_pretrained(
        build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    )


@pytest.fixture
def make_runner(tokenizer):
    runners = []

    def make(agent_class, replies=("The answer is 3.",), **config):
        class Runner(ChatRunner):
            pass

        Runner.agent_class = agent_class
        config.setdefault("generator_timeout_s", 10)
        runner = Runner(FakeGenerator(tokenizer, replies), tokenizer, RolloutConfig(**config))
        runners.append(runner)
        return runner, runner.generator

    yield make
    for runner in runners:
        runner.close()


def run(runner, row=ROW, rollout_id="r0"):
    return asyncio.run(runner.run(row, rollout_id=rollout_id, group_id="g0"))


def add(args: dict) -> str:
    return str(args["a"] + args["b"])


class OpenAIStreamingAgent(ChatAgent):
    """A tool loop on the stock async OpenAI SDK, streaming every turn."""

    async def run(self, ctx: ChatContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = list(ctx.messages)
        n_calls = 0
        async with client:
            for _ in range(4):
                content, calls = "", {}
                stream = await client.chat.completions.create(
                    model=ctx.model, messages=messages, tools=ctx.tools, stream=True
                )
                async for chunk in stream:
                    delta = chunk.choices[0].delta if chunk.choices else None
                    content += (delta and delta.content) or ""
                    for tc in (delta and delta.tool_calls) or []:
                        calls[tc.index] = tc
                message = {"role": "assistant", "content": content}
                if not calls:
                    break
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": c.function.model_dump()}
                    for c in calls.values()
                ]
                messages.append(message)
                n_calls += len(calls)
                for c in calls.values():
                    result = add(json.loads(c.function.arguments))
                    messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
        correct = content.strip().endswith(ctx.label + ".")
        return Result(reward=float(correct), info={"tool_calls": n_calls, "tag": "x"})


class AnthropicAgent(ChatAgent):
    """The same task on the stock async Anthropic SDK, streaming or not."""

    stream = False

    async def run(self, ctx: ChatContext) -> Result:
        client = anthropic.AsyncAnthropic(
            base_url=ctx.anthropic_base_url, api_key=ctx.api_key, max_retries=0
        )
        args = ctx.anthropic_args()
        async with client:
            for _ in range(4):
                if self.stream:
                    async with client.messages.stream(model=ctx.model, **args) as stream:
                        reply = await stream.get_final_message()
                else:
                    reply = await client.messages.create(model=ctx.model, **args)
                if reply.stop_reason != "tool_use":
                    break
                results = [
                    {"type": "tool_result", "tool_use_id": b.id, "content": add(b.input)}
                    for b in reply.content
                    if b.type == "tool_use"
                ]
                args["messages"] = [
                    *args["messages"],
                    {"role": "assistant", "content": reply.content},
                    {"role": "user", "content": results},
                ]
        text = "".join(b.text for b in reply.content if b.type == "text")
        return Result(reward=float(text.endswith(ctx.label + ".")))


class CompactingAgent(ChatAgent):
    """Asks twice, then replaces the history by a summary: a rewritten prefix."""

    async def run(self, ctx: ChatContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = list(ctx.messages)
        async with client:
            for question in ("And 2+2?", None):
                r = await client.chat.completions.create(model=ctx.model, messages=messages)
                messages.append(r.choices[0].message.model_dump(exclude_none=True))
                if question:
                    messages.append({"role": "user", "content": question})
            summary = [
                messages[0],
                {"role": "user", "content": "Summary: we added numbers. Say bye."},
            ]
            await client.chat.completions.create(model=ctx.model, messages=summary)
        return Result(reward=0.5)


def test_openai_streaming_tool_agent(make_runner):
    runner, gen = make_runner(OpenAIStreamingAgent, [CALL, "The answer is 3."])
    rollout = run(runner)
    assert rollout.reward == 1.0 and rollout.rollout_id == "r0" and rollout.group_id == "g0"
    (seg,) = rollout.segments
    assert_token_exact(rollout.segments, gen.calls)
    assert rollout.info == {"tool_calls": 1.0, "turns": 2.0, "segments": 1.0}  # "tag" dropped
    assert set(rollout.timings) == {"agent", "total"}
    decoded = runner.tokenizer.decode(seg.token_ids)
    assert "<tool_response>\n3\n</tool_response>" in decoded and "Be brief." in decoded


def test_a_seeded_runner_seeds_each_session_turn(make_runner):
    """--rollout.seed: the session's seed is a function of (seed, rollout id), each turn's of
    (session seed, turn): the agent's requests need no seed of their own."""
    runner, gen = make_runner(OpenAIStreamingAgent, [CALL, "The answer is 3."], seed=5)
    run(runner, rollout_id="p2-1")
    session = derive_seed(5, "p2-1")
    assert [c.params.seed for c in gen.calls] == [derive_seed(session, t) for t in (0, 1)]


class AnthropicStreamingAgent(AnthropicAgent):
    stream = True


@pytest.mark.parametrize("agent", [AnthropicAgent, AnthropicStreamingAgent])
def test_anthropic_tool_agent(make_runner, agent):
    runner, gen = make_runner(agent, [CALL, "The answer is 3."])
    rollout = run(runner)
    assert rollout.reward == 1.0
    assert len(rollout.segments) == 1
    assert_token_exact(rollout.segments, gen.calls)


def test_compaction_gives_segments_sharing_the_reward(make_runner):
    runner, gen = make_runner(CompactingAgent, ["Four.", "Bye."])
    rollout = run(runner)
    assert len(rollout.segments) == 2 and rollout.info["segments"] == 2.0
    assert_token_exact(rollout.segments, gen.calls)
    assert rollout.reward == 0.5  # one reward and rollout id for every segment
    assert [len(s.turns) for s in rollout.segments] == [2, 1]


def test_both_forms_present_identical_prompt_tokens(tokenizer, make_runner):
    """One data path: the Env runner's pre-render equals what the capture server renders from
    the messages each SDK sends, for a row with a system turn and tool schemas."""

    class Done(Env):
        async def step(self, state):
            return Result(0.0)

    class Once(ChatAgent):
        async def run(self, ctx):
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
            async with client:
                await client.chat.completions.create(
                    model=ctx.model, messages=ctx.messages, tools=ctx.tools
                )
            return Result(0.0)

    class OnceAnthropic(ChatAgent):
        async def run(self, ctx):
            client = anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key="k")
            async with client:
                await client.messages.create(model=ctx.model, **ctx.anthropic_args())
            return Result(0.0)

    class Runner(EnvRunner):
        env_class = Done

    env_gen = FakeGenerator(tokenizer, ["x"])
    run(Runner(env_gen, tokenizer), row=copy.deepcopy(ROW))
    prompts = [env_gen.calls[0].token_ids]
    for agent in (Once, OnceAnthropic):
        runner, gen = make_runner(agent)
        run(runner, row=copy.deepcopy(ROW))
        prompts.append(gen.calls[0].token_ids)
    assert prompts[0] == prompts[1] == prompts[2]
    text = tokenizer.decode(prompts[0])
    assert "Be brief." in text and '"description": "Add two integers."' in text


def test_raising_agent_is_dropped(make_runner):
    class Raising(ChatAgent):
        async def run(self, ctx):
            raise ValueError("boom")

    runner, _ = make_runner(Raising)
    dropped = run(runner)
    assert isinstance(dropped, Dropped) and dropped.reason == "agent_error"
    assert dropped.detail.startswith("ValueError: boom (test_chat_runner.py:")
    assert not runner.server.sessions  # the session was closed


def test_agent_failing_after_a_model_call_is_dropped(make_runner):
    class FailsLate(ChatAgent):
        async def run(self, ctx):
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
            async with client:
                await client.chat.completions.create(model=ctx.model, messages=ctx.messages)
            return Result(reward="high")

    runner, _ = make_runner(FailsLate)
    dropped = run(runner)
    assert dropped.reason == "bad_result" and "'high'" in dropped.detail
    assert not runner.server.sessions


def test_hanging_agents_are_dropped_at_the_deadline(make_runner):
    class Sleeper(ChatAgent):
        async def run(self, ctx):
            await asyncio.sleep(60)

    class Stubborn(ChatAgent):
        async def run(self, ctx):
            for _ in range(2):  # swallows the first cancellation
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    continue
            return Result(1.0)

    for agent in (Sleeper, Stubborn):
        runner, _ = make_runner(agent, deadline_s=0.3)
        t = time.monotonic()
        dropped = run(runner)  # waited for, the agent would take 60 s or more
        assert dropped.reason == "deadline" and time.monotonic() - t < 10, dropped
        assert not runner.server.sessions


def test_agent_stuck_in_a_model_call_is_dropped_and_runner_recovers(make_runner):
    runner, gen = make_runner(OpenAIStreamingAgent, ["The answer is 3."], deadline_s=0.3)
    gen.delay_s = 8.0  # waited for, the call would end after 8 s
    t = time.monotonic()
    assert run(runner).reason == "deadline" and time.monotonic() - t < 5
    gen.delay_s = 0.0
    runner.config.deadline_s = 10
    assert run(runner, rollout_id="r1").reward == 1.0


def test_agent_constructor_failure_is_dropped(make_runner):
    class NeedsConfig(ChatAgent):
        def __init__(self):
            raise FileNotFoundError("config.yaml")

        async def run(self, ctx):
            return Result(1.0)

    runner, _ = make_runner(NeedsConfig)
    dropped = run(runner)
    assert dropped.reason == "agent_error" and "FileNotFoundError" in dropped.detail


def test_agent_that_never_calls_the_model(make_runner):
    class Lazy(ChatAgent):
        async def run(self, ctx):
            return Result(1.0)

    runner, _ = make_runner(Lazy)
    assert run(runner).reason == "empty"


def test_context_carries_row_and_sampling(make_runner):
    seen = []

    class Peek(ChatAgent):
        async def run(self, ctx):
            seen.append(ctx)
            raise RuntimeError("just looking")

    runner, _ = make_runner(Peek, temperature=0.7, max_tokens=64, max_len=512, deadline_s=9)
    run(runner)
    (ctx,) = seen
    assert ctx.messages == ROW["prompt"] and ctx.label == "3" and ctx.row is ROW
    assert ctx.base_url == ctx.anthropic_base_url and "/s/" in ctx.base_url
    assert ctx.tools[0]["function"] == {
        "name": "add",
        "description": "Add two integers.",
        "parameters": ADD_TOOL["function"]["parameters"],
    }
    assert (ctx.temperature, ctx.max_tokens, ctx.max_len, ctx.deadline_s) == (0.7, 64, 512, 9)
    assert (ctx.rollout_id, ctx.group_id, ctx.model) == ("r0", "g0", "molt-policy")


def test_group_of_agents_runs_concurrently_on_one_server(make_runner):
    runner, gen = make_runner(OpenAIStreamingAgent, ["The answer is 3."])
    gen.hold_until_concurrent(8)  # the engine answers once all 8 agents are asking

    async def group():
        return await asyncio.gather(
            *(runner.run(ROW, rollout_id=f"r{i}", group_id="g") for i in range(8))
        )

    rollouts = asyncio.run(group())
    assert gen.peak == 8
    assert [r.reward for r in rollouts] == [1.0] * 8
    assert len({c.session_id for c in gen.calls}) == 8


def test_agent_can_drop_on_purpose(make_runner):
    class Picky(ChatAgent):
        async def run(self, ctx):
            raise RolloutDropped("unusable_prompt", "label missing")

    runner, _ = make_runner(Picky)
    assert run(runner).reason == "unusable_prompt"


def test_with_sampling_shares_the_capture_server(make_runner):
    runner, gen = make_runner(OpenAIStreamingAgent, temperature=1.0)
    sibling = runner.with_sampling(RolloutConfig(temperature=0.25, max_tokens=7))
    assert run(sibling).segments and run(runner).reward == 1.0  # 7 tokens: a cut reply
    assert sibling.server is runner.server  # one capture server per runner process
    eval_call, train_call = gen.calls
    assert (eval_call.params.temperature, eval_call.params.max_tokens) == (0.25, 7)
    assert train_call.params.temperature == 1.0
    sibling.close()  # the owner's to stop, not the sibling's
    assert runner._server is not None


def test_agent_raising_after_an_engine_failure_is_an_engine_error(make_runner):
    """The capture server answers 502 when the engine call fails (a dead engine); whatever the
    agent's SDK makes of it, the rollout is counted as `engine_error`, not as the agent's."""

    class AsksOnce(ChatAgent):
        async def run(self, ctx):
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            async with client:
                await client.chat.completions.create(model=ctx.model, messages=ctx.messages)
            return Result(reward=1.0)

    runner, gen = make_runner(AsksOnce)
    gen.fail_next = ConnectionError("engine 0 exited with code -9")
    dropped = run(runner)
    assert dropped.reason == "engine_error" and "InternalServerError" in dropped.detail
    assert isinstance(run(runner, rollout_id="r1"), Rollout)  # the next rollout is unaffected
    assert not runner._engine_failed  # nothing kept per finished rollout


def test_context_clients_share_one_connection_pool_per_event_loop(make_runner):
    """`ctx.openai_client()` / `ctx.anthropic_client()`: stock SDK clients pointed at the
    session, all on one HTTP client per SDK and event loop, which an agent's `async with`
    does not close: eight concurrent rollouts that each close theirs all finish."""
    pools = []

    class Both(ChatAgent):
        async def run(self, ctx):
            async with ctx.openai_client(max_retries=0) as client:
                assert isinstance(client, openai.AsyncOpenAI) and client.max_retries == 0
                await asyncio.sleep(0.05)  # the others close theirs meanwhile
                reply = await client.chat.completions.create(model=ctx.model, messages=ctx.messages)
            async with ctx.anthropic_client() as other:
                assert str(other.base_url).rstrip("/") == ctx.anthropic_base_url.rstrip("/")
                await other.messages.create(model=ctx.model, **ctx.anthropic_args())
            pools.append((client._client, other._client))
            return Result(float("3" in (reply.choices[0].message.content or "")))

    runner, gen = make_runner(Both, ["The answer is 3."])

    async def group():
        return await asyncio.gather(
            *(runner.run(ROW, rollout_id=f"r{i}", group_id="g") for i in range(8))
        )

    assert [r.reward for r in asyncio.run(group())] == [1.0] * 8
    assert len(gen.calls) == 16 and len(set(pools)) == 1
    ((openai_pool, anthropic_pool),) = set(pools)
    assert openai_pool is not anthropic_pool and not openai_pool.is_closed
    assert [r.reward for r in asyncio.run(group())] == [1.0] * 8  # a new loop, new pools
    assert len(set(pools)) == 2
