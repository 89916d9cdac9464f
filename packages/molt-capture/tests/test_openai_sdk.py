"""The stock openai SDK against the live server; every scenario checks the trace invariant."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from molt_capture.testing import ADD_TOOL, assert_token_exact, tool_call_text


def openai_client(session, **kw) -> openai.OpenAI:
    """A stock client pointed at the session, as an agent would build it."""
    kw = {"api_key": "any", "max_retries": 0, **kw}
    return openai.OpenAI(base_url=session.base_url, **kw)


USER = {"role": "user", "content": "What is 1+2?"}
CALL = "<think>\nI should add.\n</think>\n\nLet me add.\n" + tool_call_text("add", {"a": 1, "b": 2})


def close(server, gen, session):
    segments = server.close_session(session.id)
    assert_token_exact(segments, gen.calls_for(session.id))
    return segments


def test_sync_multi_turn_with_tools_and_reasoning(server, gen):
    gen.set_replies([CALL, "The answer is 3."])
    s = server.open_session()
    client = openai_client(s)
    messages = [USER]
    r1 = client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL])
    choice = r1.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me add."
    assert choice.message.model_extra["reasoning_content"] == "I should add."
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert r1.usage.completion_tokens == len(gen.calls_for(s.id)[0].generation.token_ids)
    assert r1.usage.prompt_tokens == len(gen.calls_for(s.id)[0].token_ids)
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "3"},
    ]
    r2 = client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL])
    assert (
        r2.choices[0].message.content == "The answer is 3."
        and r2.choices[0].finish_reason == "stop"
    )
    (seg,) = close(server, gen, s)
    # The tool's schema reached the template, the tool result the second turn's render.
    text = server.renderer.tokenizer.decode(seg.token_ids)
    assert '"name": "add"' in text and "<tool_response>\n3\n</tool_response>" in text


def test_async_sessions_run_in_parallel(server, gen):
    gen.set_replies(["Hi."])
    gen.hold_until_concurrent(8)  # the first turns are answered once all 8 are asking
    sessions = [server.open_session() for _ in range(8)]

    async def episode(s):
        client = openai.AsyncOpenAI(base_url=server.base_url(s.id), api_key="k", max_retries=0)
        msgs = [USER]
        for _ in range(2):
            r = await client.chat.completions.create(model="m", messages=msgs)
            msgs += [
                r.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "more"},
            ]
        await client.close()

    async def main():
        await asyncio.gather(*(episode(s) for s in sessions))

    asyncio.run(main())
    assert gen.peak == 8  # sessions overlapped instead of queueing
    for s in sessions:
        assert len(close(server, gen, s)[0].turns) == 2


def test_streaming_matches_the_non_streaming_reply(server, gen):
    gen.set_replies([CALL])
    s = server.open_session()
    client = openai_client(s)
    stream = client.chat.completions.create(
        model="m",
        messages=[USER],
        tools=[ADD_TOOL],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == len(gen.calls_for(s.id)[0].generation.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Let me add."
    # The SDK's stream helper accumulates the same message.
    s2 = server.open_session()
    with openai_client(s2).chat.completions.stream(
        model="m", messages=[USER], tools=[ADD_TOOL]
    ) as st:
        final = st.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.name == "add"
    close(server, gen, s)
    close(server, gen, s2)


def test_stop_sequences_and_max_tokens(server, gen):
    gen.set_replies(["alpha beta END gamma", "a b c d e f g h"])
    s = server.open_session()
    client = openai_client(s)
    r = client.chat.completions.create(model="m", messages=[USER], stop=["END"])
    assert r.choices[0].message.content == "alpha beta" and r.choices[0].finish_reason == "stop"
    assert gen.calls_for(s.id)[0].params.stop == ["END"]
    msgs = [
        USER,
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "?"},
    ]
    r = client.chat.completions.create(
        model="m", messages=msgs, max_completion_tokens=3, temperature=1.0, top_p=0.5
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    first, second = close(server, gen, s)  # a changed top_p starts a new segment
    assert (first.top_p, second.top_p, second.turns[0].max_tokens) == (1.0, 0.5, 3)


def test_compaction_gives_segments_of_one_rollout(server, gen):
    gen.set_replies(["One.", "Two.", "Three."])
    s = server.open_session()
    client = openai_client(s)
    msgs = [USER]
    for _ in range(2):
        r = client.chat.completions.create(model="m", messages=msgs)
        msgs += [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "next"},
        ]
    client.chat.completions.create(
        model="m", messages=[{"role": "system", "content": "Summary so far."}, msgs[-1]]
    )
    segments = close(server, gen, s)
    assert [len(x.turns) for x in segments] == [2, 1]


def test_identical_retry_returns_the_cached_reply(server, gen):
    gen.set_replies(["One.", "Two."])
    s = server.open_session()
    client = openai_client(s)
    a = client.chat.completions.create(model="m", messages=[USER])
    b = client.chat.completions.create(model="m", messages=[USER])
    assert a.choices[0].message.content == b.choices[0].message.content == "One."
    assert len(gen.calls_for(s.id)) == 1
    assert len(close(server, gen, s)[0].turns) == 1


def test_sdk_retry_after_generator_failure_records_once(server, gen):
    gen.set_replies(["One."])
    gen.fail_next = RuntimeError("engine restarting")
    s = server.open_session()
    client = openai_client(s).with_options(max_retries=2)
    r = client.chat.completions.create(model="m", messages=[USER])
    assert r.choices[0].message.content == "One."
    assert len(close(server, gen, s)[0].turns) == 1


def test_errors_reach_the_sdk_as_typed_exceptions(server, gen):
    s = server.open_session()
    client = openai_client(s)
    with pytest.raises(openai.BadRequestError, match="group size"):
        client.chat.completions.create(model="m", messages=[USER], n=2)
    with pytest.raises(openai.BadRequestError, match="messages.0.role"):
        client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(
            model="m", messages=[USER], tools=[ADD_TOOL], tool_choice="required"
        )
    gen.fail_next = RuntimeError("engine down")
    with pytest.raises(openai.InternalServerError, match="engine down") as e:
        client.chat.completions.create(model="m", messages=[USER])
    assert e.value.status_code == 502
    assert close(server, gen, s) == []
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="m", messages=[USER])


def test_models_listing(server):
    s = server.open_session()
    assert [m.id for m in openai_client(s).models.list()] == [server.model_name]
    server.close_session(s.id)


def test_plain_streaming_and_tool_choice_none(server, gen):
    gen.set_replies(["Just text.", CALL])
    s = server.open_session()
    client = openai_client(s)
    with client.chat.completions.stream(model="m", messages=[USER]) as st:
        final = st.get_final_completion()
    assert (
        final.choices[0].message.content == "Just text."
        and final.choices[0].finish_reason == "stop"
    )
    msgs = [
        USER,
        {"role": "assistant", "content": "Just text."},
        {"role": "user", "content": "Now?"},
    ]
    r = client.chat.completions.create(
        model="m", messages=msgs, tools=[ADD_TOOL], tool_choice="none"
    )
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert "<tool_call>" in r.choices[0].message.content  # the markup is returned as text
    close(server, gen, s)
