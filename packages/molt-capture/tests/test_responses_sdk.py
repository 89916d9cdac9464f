"""The stock openai SDK's Responses API, and the openai-agents SDK on top of it, against the
live server; every scenario checks the trace invariant."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from molt_capture.testing import ADD_TOOL, assert_token_exact, tool_call_text

TOOL = {"type": "function", **ADD_TOOL["function"]}  # the Responses form of the tool
IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
CALL = "<think>\nI should add.\n</think>\n\nLet me add.\n" + tool_call_text("add", {"a": 1, "b": 2})


def client(session, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=session.base_url, api_key="any", max_retries=0, **kw)


def close(server, gen, session):
    segments = server.close_session(session.id)
    assert_token_exact(segments, gen.calls_for(session.id))
    return segments


def test_tool_loop_echoing_output_items(server, gen):
    gen.set_replies([CALL, "The answer is 3."])
    s = server.open_session()
    c = client(s)
    items: list = [{"role": "user", "content": "What is 1+2?"}]
    r1 = c.responses.create(model="m", instructions="Be brief.", input=items, tools=[TOOL])
    assert [o.type for o in r1.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = r1.output
    assert reasoning.content[0].text == "I should add." and message.content[0].text == "Let me add."
    assert call.name == "add" and json.loads(call.arguments) == {"a": 1, "b": 2}
    first = gen.calls_for(s.id)[0]
    assert r1.usage.input_tokens == len(first.token_ids)
    assert r1.usage.output_tokens == len(first.generation.token_ids)
    items += [o.model_dump(exclude_none=True) for o in r1.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "3"})
    r2 = c.responses.create(model="m", instructions="Be brief.", input=items, tools=[TOOL])
    assert r2.output_text == "The answer is 3." and r2.status == "completed"
    (seg,) = close(server, gen, s)
    text = server.renderer.tokenizer.decode(seg.token_ids)
    assert text.startswith("<|im_start|>system\nBe brief.") and '"name": "add"' in text
    assert "<tool_response>\n3\n</tool_response>" in text


def test_previous_response_id_continues_the_segment(server, gen):
    gen.set_replies([CALL, "It is 3.", "Bye."])
    s = server.open_session()
    c = client(s)
    r1 = c.responses.create(model="m", input="What is 1+2?", tools=[TOOL])
    call = r1.output[-1]
    r2 = c.responses.create(
        model="m",
        previous_response_id=r1.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "3"}],
        tools=[TOOL],
    )
    r3 = c.responses.create(model="m", previous_response_id=r2.id, input="Thanks!", tools=[TOOL])
    assert (r2.output_text, r3.output_text) == ("It is 3.", "Bye.")
    (seg,) = close(server, gen, s)
    assert len(seg.turns) == 3
    with pytest.raises(openai.NotFoundError):  # the session is closed
        c.responses.create(model="m", previous_response_id=r3.id, input="?")


def test_streaming_events_feed_the_sdk_helper(server, gen):
    gen.set_replies([CALL, "Plain text."])
    s = server.open_session()
    c = client(s)
    with c.responses.stream(model="m", input="What is 1+2?", tools=[TOOL]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.reasoning_text.delta" in kinds
    assert "response.function_call_arguments.delta" in kinds
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert json.loads(final.output[-1].arguments) == {"a": 1, "b": 2}
    # A raw stream (stream=True) of a follow-up, text deltas in order.
    events = list(
        c.responses.create(
            model="m",
            previous_response_id=final.id,
            input=[
                {"type": "function_call_output", "call_id": final.output[-1].call_id, "output": "3"}
            ],
            tools=[TOOL],
            stream=True,
        )
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        "Plain text."
    )
    assert events[-1].response.usage.output_tokens == len(
        gen.calls_for(s.id)[1].generation.token_ids
    )
    (seg,) = close(server, gen, s)
    assert len(seg.turns) == 2


def test_max_output_tokens_is_incomplete(server, gen):
    gen.set_replies(["a long answer with many tokens"])
    s = server.open_session()
    r = client(s).responses.create(model="m", input="Talk.", max_output_tokens=3, temperature=0.5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    (seg,) = close(server, gen, s)
    assert (seg.temperature, seg.turns[0].max_tokens) == (0.5, 3)


def test_refusals_name_the_field(server, gen):
    s = server.open_session()
    c = client(s)
    cases = [
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "3"}]}, "input.0"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "multimodal",
        ),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "add", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c", "output": [IMAGE]},
                ]
            },
            "multimodal",
        ),
        ({"input": "x", "tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
        ({"input": "x", "extra_body": {"top_k": 5}}, "top_k"),
    ]
    for body, match in cases:
        with pytest.raises(openai.BadRequestError, match=match):
            c.responses.create(model="m", **body)
    assert close(server, gen, s) == []


@pytest.mark.parametrize("model_class", [None, "OpenAIChatCompletionsModel"])
def test_openai_agents_sdk_runs_a_tool_loop(server, gen, model_class):
    agents = pytest.importorskip("agents")
    s = server.open_session()

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    async def main(streamed: bool) -> str:
        sdk = openai.AsyncOpenAI(base_url=s.base_url, api_key="any", max_retries=0)
        if model_class is None:  # the SDK's default model (Responses) and settings
            agents.set_default_openai_client(sdk, use_for_tracing=False)
            model = None
        else:
            model = getattr(agents, model_class)(model="gpt-4.1", openai_client=sdk)
        agent = agents.Agent(name="calc", instructions="Use the tool.", tools=[add], model=model)
        if streamed:
            run = agents.Runner.run_streamed(agent, "What is 1+2?")
            async for _ in run.stream_events():
                pass
        else:
            run = await agents.Runner.run(agent, "What is 1+2?")
        await sdk.close()
        return run.final_output

    agents.set_tracing_disabled(True)
    gen.set_replies([tool_call_text("add", {"a": 1, "b": 2}), "The answer is 3."])
    assert asyncio.run(main(streamed=False)) == "The answer is 3."
    (seg,) = close(server, gen, s)
    text = server.renderer.tokenizer.decode(seg.token_ids)
    assert len(seg.turns) == 2 and "<tool_response>\n3\n</tool_response>" in text
    s = server.open_session()
    gen.set_replies([tool_call_text("add", {"a": 1, "b": 2}), "The answer is 3."])
    assert asyncio.run(main(streamed=True)) == "The answer is 3."
    (seg,) = close(server, gen, s)
    assert len(seg.turns) == 2
