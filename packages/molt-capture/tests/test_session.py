"""Token-exact accumulation and segmentation, driven directly (no HTTP)."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from molt_capture import CaptureError, ChatRenderer, ChatRequest, Session, SessionConfig
from molt_capture.testing import FakeGenerator, assert_token_exact, routing_row, tool_call_text
from molt_capture.tiny_tokenizer import QWEN3_STYLE_TEMPLATE
from molt_capture.types import derive_seed

USER = {"role": "user", "content": "What is 1+2?"}


def turn(session, renderer, gen, messages, **kw):
    req = ChatRequest(messages=messages, **kw)
    raw = json.dumps({"m": messages, **kw}).encode()
    return asyncio.run(session.turn(req, raw, renderer, gen, 5.0))


def echo(result) -> dict:
    return result.reply.as_message()


@pytest.fixture
def renderer(tokenizer):
    return ChatRenderer(tokenizer, "qwen3")


def test_multi_turn_appends_only_the_delta(tokenizer, renderer):
    gen = FakeGenerator(tokenizer, ["One.", "Two."])
    s = Session("s", SessionConfig())
    r1 = turn(s, renderer, gen, [USER])
    msgs = [USER, echo(r1), {"role": "user", "content": "And then?"}]
    turn(s, renderer, gen, msgs)
    (seg,) = s.segments()
    assert_token_exact([seg], gen.calls)
    # Turn 2's engine prompt is turn 1's exact trace plus only the new render delta.
    first_end = seg.turns[0].end
    assert (
        gen.calls[1].token_ids[:first_end]
        == gen.calls[0].token_ids + gen.calls[0].generation.token_ids
    )
    full = renderer.render([*msgs, {"role": "assistant", "content": "Two."}], None, False)
    assert tokenizer.decode(seg.token_ids) == full  # trained sequence reads as deployment renders


def test_template_tokens_after_the_assistant_message_are_appended(tokenizer):
    # A template that closes assistant turns with more than the engine's stop token.
    template = QWEN3_STYLE_TEMPLATE.replace(
        "{{- '}\\n</tool_call>' -}}{%- endfor -%}{{- '<|im_end|>\\n' -}}",
        "{{- '}\\n</tool_call>' -}}{%- endfor -%}{{- '<|im_end|><|endoftext|>\\n' -}}",
    )
    assert template != QWEN3_STYLE_TEMPLATE
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = template
    renderer = ChatRenderer(tokenizer, "qwen3")
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert renderer.closing_ids[:2] == [tokenizer.convert_tokens_to_ids("<|im_end|>"), eot]
    gen = FakeGenerator(tokenizer, ["One.", "Two."])
    s = Session("s", SessionConfig())
    r1 = turn(s, renderer, gen, [USER])
    seg = s.current
    tail = seg.token_ids[seg.turns[0].end :]
    assert tail == renderer.closing_ids[1:] and seg.trainable[seg.turns[0].end :] == [0] * len(tail)
    msgs = [USER, echo(r1), {"role": "user", "content": "More?"}]
    turn(s, renderer, gen, msgs)
    assert len(s.segments()) == 1
    assert_token_exact(s.segments(), gen.calls)
    full = renderer.render([*msgs, {"role": "assistant", "content": "Two."}], None, False)
    assert tokenizer.decode(s.current.token_ids) == full


def test_history_that_does_not_round_trip_keeps_generated_tokens(tokenizer, renderer):
    # The model writes compact JSON; the template re-renders it with spaces. The trace must keep
    # what was sampled (no re-tokenisation), without segmenting the episode.
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    compact = tool_call_text("add", {"a": 1, "b": 2}, compact=True)
    gen = FakeGenerator(tokenizer, [compact, "3."])
    s = Session("s", SessionConfig())
    r1 = turn(s, renderer, gen, [USER], tools=tools)
    assert r1.finish_reason == "tool_calls"
    msgs = [USER, echo(r1), {"role": "tool", "content": "3", "tool_call_id": "x"}]
    turn(s, renderer, gen, msgs, tools=tools)
    (seg,) = s.segments()
    assert_token_exact([seg], gen.calls)
    text = tokenizer.decode(seg.token_ids)
    assert '{"name":"add","arguments":{"a":1,"b":2}}' in text
    # Between the turns: the end-of-turn separator, then exactly the template's new text.
    history = renderer.render(msgs[:2], tools, False)
    delta = renderer.render(msgs, tools, True)[len(history) :]
    between = seg.token_ids[seg.turns[0].end : seg.turns[1].start]
    assert tokenizer.decode(between) == "\n" + delta and delta.startswith("<|im_start|>user\n<tool")
    assert text != renderer.render([*msgs, {"role": "assistant", "content": "3."}], tools, False)


def test_rewritten_history_opens_a_new_segment(tokenizer, renderer):
    gen = FakeGenerator(tokenizer, ["One.", "Two.", "Three."])
    s = Session("s", SessionConfig())
    r1 = turn(s, renderer, gen, [USER])
    r2 = turn(s, renderer, gen, [USER, echo(r1), {"role": "user", "content": "Next"}])
    # Compaction: the agent replaces the history with a summary.
    summary = [{"role": "user", "content": "Summary: 1+2 asked. " + r2.reply.content}]
    turn(s, renderer, gen, summary)
    segs = s.segments()
    assert len(segs) == 2 and [len(x.turns) for x in segs] == [2, 1]
    assert_token_exact(segs, gen.calls)
    assert gen.calls[2].token_ids == renderer.encode(renderer.render(summary, None, True))


def test_a_seeded_session_gives_each_turn_its_own_seed(tokenizer, renderer):
    """--rollout.seed: turn k samples with derive_seed(seed, k), across segments too; the same
    session replayed asks for the same seeds; an unseeded one leaves sampling to the engine."""
    summary = [{"role": "user", "content": "Summary."}]  # a rewrite: a new segment

    def seeds(config: SessionConfig) -> list:
        gen = FakeGenerator(tokenizer, ["One.", "Two.", "Three."])
        s = Session("s", config)
        r1 = turn(s, renderer, gen, [USER])
        turn(s, renderer, gen, [USER, echo(r1), {"role": "user", "content": "Next"}])
        turn(s, renderer, gen, summary)
        assert len(s.segments()) == 2
        return [call.params.seed for call in gen.calls]

    assert seeds(SessionConfig(seed=7)) == [derive_seed(7, k) for k in range(3)]
    assert seeds(SessionConfig(seed=7)) != seeds(SessionConfig(seed=8))
    assert len(set(seeds(SessionConfig(seed=7)))) == 3
    assert seeds(SessionConfig()) == [None] * 3
    # No per-process hash salt: a run's seeds are the same in every process and every run.
    assert derive_seed(0, "p3-1", 2) == 856382519


def test_edited_reply_is_a_rewrite(tokenizer, renderer):
    gen = FakeGenerator(tokenizer, ["One.", "Two."])
    s = Session("s", SessionConfig())
    turn(s, renderer, gen, [USER])
    turn(
        s,
        renderer,
        gen,
        [USER, {"role": "assistant", "content": "Edited."}, {"role": "user", "content": "?"}],
    )
    assert len(s.segments()) == 2
    assert_token_exact(s.segments(), gen.calls)


def test_template_that_drops_earlier_reasoning_keeps_one_segment(tokenizer):
    # The template drops the first reply's reasoning once a user message follows; the trace
    # keeps it as generated (history comes from recorded tokens), so nothing splits.
    replies = ["<think>\nplan\n</think>\n\nOne.", "<think>\nmore\n</think>\n\nTwo."]
    for kwargs, n_segments in (({}, 1), ({"preserve_thinking": True}, 1)):
        renderer = ChatRenderer(tokenizer, "qwen3", kwargs)
        gen = FakeGenerator(tokenizer, replies)
        s = Session("s", SessionConfig())
        r1 = turn(s, renderer, gen, [USER])
        assert r1.reply.reasoning == "plan"
        turn(s, renderer, gen, [USER, echo(r1), {"role": "user", "content": "And?"}])
        assert len(s.segments()) == n_segments
        assert_token_exact(s.segments(), gen.calls)


def test_tool_results_keep_reasoning_in_one_segment(tokenizer, renderer):
    # Qwen3 keeps reasoning after the last *user* query, so a tool loop stays one segment.
    call = "<think>\nneed a tool\n</think>\n\n" + tool_call_text("add", {"a": 1, "b": 2})
    gen = FakeGenerator(tokenizer, [call, call, "Done."])
    s = Session("s", SessionConfig())
    msgs = [USER]
    for _ in range(3):
        r = turn(s, renderer, gen, msgs)
        msgs = [*msgs, echo(r), {"role": "tool", "content": "3", "tool_call_id": "c"}]
    assert len(s.segments()) == 1 and len(s.current.turns) == 3
    assert_token_exact(s.segments(), gen.calls)


def test_temperature_top_p_and_max_tokens_are_recorded(tokenizer, renderer):
    gen = FakeGenerator(tokenizer, ["a long answer with many tokens"])
    s = Session("s", SessionConfig(temperature=1.0))
    r1 = turn(s, renderer, gen, [USER], temperature=0.5, top_p=0.9, max_tokens=4)
    assert r1.finish_reason == "length" and r1.completion_tokens == 4
    assert (gen.calls[0].params.temperature, gen.calls[0].params.top_p) == (0.5, 0.9)
    seg = s.current
    assert (seg.temperature, seg.top_p, seg.turns[0].max_tokens) == (0.5, 0.9, 4)
    assert not seg.truncated  # the request's limit, not the context's
    # A different temperature on the next turn starts a new segment (one temperature each).
    turn(s, renderer, gen, [USER, echo(r1), {"role": "user", "content": "go on"}], temperature=1.0)
    assert [x.temperature for x in s.segments()] == [0.5, 1.0]


def test_strict_temperature_refuses_a_different_temperature(tokenizer, renderer):
    gen = FakeGenerator(tokenizer)
    s = Session("s", SessionConfig(temperature=1.0, strict_temperature=True))
    with pytest.raises(CaptureError) as e:
        turn(s, renderer, gen, [USER], temperature=0.3)
    assert e.value.status == 400 and e.value.param == "temperature"
    turn(s, renderer, gen, [USER], temperature=1.0)
    assert len(s.segments()) == 1


def test_budget_clamps_and_full_context_answers_length(tokenizer, renderer):
    gen = FakeGenerator(tokenizer, ["x" * 200])
    prompt_len = len(renderer.encode(renderer.render([USER], None, True)))
    s = Session("s", SessionConfig(max_len=prompt_len + 10))
    r1 = turn(s, renderer, gen, [USER], max_tokens=500)
    assert gen.calls[0].params.max_tokens == 10
    assert (
        r1.finish_reason == "length" and s.current.truncated and len(s.current) == prompt_len + 10
    )
    r2 = turn(s, renderer, gen, [USER, echo(r1), {"role": "user", "content": "more"}])
    assert r2.finish_reason == "length" and r2.completion_tokens == 0 and len(gen.calls) == 1
    assert_token_exact(s.segments(), gen.calls)


def test_identical_retry_is_answered_from_cache(tokenizer, renderer):
    gen = FakeGenerator(tokenizer, ["One.", "Two."])
    s = Session("s", SessionConfig())
    a = turn(s, renderer, gen, [USER])
    b = turn(s, renderer, gen, [USER])
    assert a is b and len(gen.calls) == 1 and len(s.current.turns) == 1


def test_generator_failure_and_timeout_leave_the_session_unchanged(tokenizer, renderer):
    gen = FakeGenerator(tokenizer, ["One."])
    s = Session("s", SessionConfig())
    gen.fail_next = RuntimeError("engine down")
    with pytest.raises(CaptureError) as e:
        turn(s, renderer, gen, [USER])
    assert e.value.status == 502 and "engine down" in e.value.message
    assert s.current is None and s.segments() == []
    gen.delay_s = 0.5

    async def slow():
        req = ChatRequest(messages=[USER])
        return await s.turn(req, b"slow", renderer, gen, 0.05)

    with pytest.raises(CaptureError) as e:
        asyncio.run(slow())
    assert e.value.status == 504 and s.current is None
    gen.delay_s = 0.0
    turn(s, renderer, gen, [USER])  # the retry runs cleanly
    assert_token_exact(s.segments(), gen.calls)


def test_routing_rows_align_with_tokens(tokenizer, renderer):
    gen = FakeGenerator(tokenizer, ["One.", "Two."], routing=True)
    s = Session("s", SessionConfig())
    r1 = turn(s, renderer, gen, [USER])
    turn(s, renderer, gen, [USER, echo(r1), {"role": "user", "content": "?"}])
    seg = s.current
    # Every position the engine ran has the engine's row for it; the last sampled token and the
    # template's closing tokens after it were never run. The second turn asked only for the
    # rows the first left out.
    last = seg.turns[-1].end - 1
    assert seg.routed_experts[:last] == [routing_row(p) for p in range(last)]
    assert seg.routed_experts[last:] == [None] * (len(seg) - last)
    first, second = gen.calls
    assert first.params.routing_start == 0
    assert second.params.routing_start == first.generation.routing_start + len(
        first.generation.routed_experts
    )


REPLIES = [
    "Plain answer.",
    "<think>\nreason\n</think>\n\nWith reasoning.",
    tool_call_text("add", {"a": 1, "b": 2}),
    "<think>\nuse a tool\n</think>\n\nCalling.\n" + tool_call_text("add", {"a": 5}, compact=True),
    "cut here STOP never seen",
]
ACTIONS = ["user", "tool", "compact", "retry", "fail"]


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    script=st.lists(
        st.tuples(st.sampled_from(ACTIONS), st.sampled_from(REPLIES)), min_size=1, max_size=8
    ),
    preserve=st.booleans(),
)
def test_any_episode_is_token_exact(tokenizer, script, preserve):
    """Random episodes (follow-ups, tool results, compaction, retries, failures, stop strings):
    the invariant holds, retries and failures record nothing."""
    renderer = ChatRenderer(tokenizer, "qwen3", {"preserve_thinking": preserve})
    pending: list[str] = []
    gen = FakeGenerator(tokenizer, lambda ids, params: pending.pop())
    s = Session("s", SessionConfig(max_len=4096))
    msgs, last, result = [USER], None, None
    for action, reply in script:
        if result is not None and action in ("user", "tool"):
            nxt = {"role": "user", "content": "Go on."}
            if action == "tool":
                nxt = {"role": "tool", "content": "7", "tool_call_id": "c1"}
            msgs = [*msgs, echo(result), nxt]
        elif action == "compact":
            msgs = [{"role": "user", "content": f"Summary of {len(msgs)} messages."}]
        n_calls, n_turns = len(gen.calls), sum(len(x.turns) for x in s.segments())
        if action == "fail":
            gen.fail_next = RuntimeError("down")
            with pytest.raises(CaptureError):  # a new request (an identical one is cached)
                turn(
                    s, renderer, gen, [*msgs, {"role": "user", "content": "Fails."}], stop=["STOP"]
                )
            assert sum(len(x.turns) for x in s.segments()) == n_turns
            continue
        pending.append(reply)
        result = turn(s, renderer, gen, msgs, stop=["STOP"])
        if action == "retry" and last == msgs:
            assert len(gen.calls) == n_calls  # answered from the cache
            pending.clear()
        last = list(msgs)
        assert "STOP" not in result.reply.content
    assert_token_exact(s.segments(), gen.calls)
