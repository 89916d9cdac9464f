"""The stock anthropic SDK against the live server; every scenario checks the trace invariant."""

from __future__ import annotations

import asyncio

import anthropic
import pytest

from molt_capture.testing import ADD_TOOL_ANTHROPIC, assert_token_exact, tool_call_text


def anthropic_client(session, **kw) -> anthropic.Anthropic:
    """A stock client pointed at the session, as an agent would build it."""
    kw = {"api_key": "any", "max_retries": 0, **kw}
    return anthropic.Anthropic(base_url=session.base_url, **kw)


USER = {"role": "user", "content": "What is 1+2?"}
CALL = "<think>\nI should add.\n</think>\n\nLet me add.\n" + tool_call_text("add", {"a": 1, "b": 2})


def close(server, gen, session):
    segments = server.close_session(session.id)
    assert_token_exact(segments, gen.calls_for(session.id))
    return segments


def test_sync_tool_use_round_trip_with_thinking(server, gen):
    gen.set_replies([CALL, "The answer is 3."])
    s = server.open_session()
    client = anthropic_client(s)
    r1 = client.messages.create(
        model="m", max_tokens=200, system="Be brief.", messages=[USER], tools=[ADD_TOOL_ANTHROPIC]
    )
    assert r1.stop_reason == "tool_use"
    assert [b.type for b in r1.content] == ["thinking", "text", "tool_use"]
    thinking, text, tool_use = r1.content
    assert thinking.thinking == "I should add." and text.text == "Let me add."
    assert tool_use.name == "add" and tool_use.input == {"a": 1, "b": 2}
    first = gen.calls_for(s.id)[0]
    assert r1.usage.input_tokens == len(first.token_ids)
    assert r1.usage.output_tokens == len(first.generation.token_ids)
    messages = [
        USER,
        {"role": "assistant", "content": r1.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "3"}],
        },
    ]
    r2 = client.messages.create(
        model="m", max_tokens=200, system="Be brief.", messages=messages, tools=[ADD_TOOL_ANTHROPIC]
    )
    assert r2.stop_reason == "end_turn" and r2.content[0].text == "The answer is 3."
    (seg,) = close(server, gen, s)
    decoded = server.renderer.tokenizer.decode(seg.token_ids)
    assert (
        "Be brief." in decoded and '"parameters": {"type": "object"' in decoded
    )  # input_schema converted
    assert "<tool_response>\n3\n</tool_response>" in decoded


def test_streaming_events_feed_the_sdk_helper(server, gen):
    gen.set_replies([CALL])
    s = server.open_session()
    client = anthropic_client(s)
    with client.messages.stream(
        model="m", max_tokens=200, messages=[USER], tools=[ADD_TOOL_ANTHROPIC]
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"a": 1, "b": 2} and final.stop_reason == "tool_use"
    assert final.usage.output_tokens == len(gen.calls_for(s.id)[0].generation.token_ids)
    close(server, gen, s)


def test_async_multi_turn_conversation(server, gen):
    gen.set_replies(["One.", "Two.", "Three."])
    s = server.open_session()

    async def episode():
        client = anthropic.AsyncAnthropic(
            base_url=server.base_url(s.id), api_key="k", max_retries=0
        )
        messages = [USER]
        for _ in range(3):
            r = await client.messages.create(model="m", max_tokens=50, messages=messages)
            messages += [
                {"role": "assistant", "content": r.content},
                {"role": "user", "content": "go on"},
            ]
        await client.close()

    asyncio.run(episode())
    (seg,) = close(server, gen, s)
    assert len(seg.turns) == 3


def test_stop_sequences_and_max_tokens(server, gen):
    gen.set_replies(["alpha beta END gamma", "a b c d e f g h"])
    s = server.open_session()
    client = anthropic_client(s)
    r = client.messages.create(model="m", max_tokens=50, messages=[USER], stop_sequences=["END"])
    assert (
        r.stop_reason == "stop_sequence"
        and r.stop_sequence == "END"
        and r.content[0].text == "alpha beta"
    )
    messages = [USER, {"role": "assistant", "content": r.content}, {"role": "user", "content": "?"}]
    r = client.messages.create(model="m", max_tokens=3, messages=messages)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3
    (seg,) = close(server, gen, s)
    assert [t.max_tokens for t in seg.turns] == [50, 3]


def test_compaction_and_retry(server, gen):
    gen.set_replies(["One.", "Two."])
    s = server.open_session()
    client = anthropic_client(s)
    r = client.messages.create(model="m", max_tokens=50, messages=[USER])
    again = client.messages.create(model="m", max_tokens=50, messages=[USER])
    assert again.content[0].text == r.content[0].text and len(gen.calls_for(s.id)) == 1
    client.messages.create(
        model="m", max_tokens=50, messages=[{"role": "user", "content": "Summary: asked 1+2."}]
    )
    assert [len(x.turns) for x in close(server, gen, s)] == [1, 1]


def test_count_tokens_matches_the_render(server, gen):
    s = server.open_session()
    client = anthropic_client(s)
    counted = client.messages.count_tokens(model="m", messages=[USER], tools=[ADD_TOOL_ANTHROPIC])
    r = client.messages.create(
        model="m", max_tokens=20, messages=[USER], tools=[ADD_TOOL_ANTHROPIC]
    )
    assert counted.input_tokens == r.usage.input_tokens
    close(server, gen, s)


def test_errors_reach_the_sdk_as_typed_exceptions(server, gen):
    s = server.open_session()
    client = anthropic_client(s)
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        client.messages.create(
            model="m",
            max_tokens=5,
            messages=[USER],
            tools=[ADD_TOOL_ANTHROPIC],
            tool_choice={"type": "any"},
        )
    with pytest.raises(anthropic.BadRequestError, match="top_k"):
        client.messages.create(model="m", max_tokens=5, messages=[USER], extra_body={"top_k": 5})
    with pytest.raises(anthropic.BadRequestError, match=r"messages\.0\.content"):
        client.messages.create(
            model="m",
            max_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "x", "name": "n", "input": {}}],
                }
            ],
        )
    gen.fail_next = RuntimeError("engine down")
    with pytest.raises(anthropic.InternalServerError, match="engine down"):
        client.messages.create(model="m", max_tokens=5, messages=[USER])
    assert close(server, gen, s) == []
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="m", max_tokens=5, messages=[USER])


def test_plain_text_stream(server, gen):
    gen.set_replies(["Just text."])
    s = server.open_session()
    with anthropic_client(s).messages.stream(model="m", max_tokens=50, messages=[USER]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Just text." and final.stop_reason == "end_turn"
    assert [b.type for b in final.content] == ["text"]
    close(server, gen, s)
