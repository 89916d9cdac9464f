"""History from recorded tokens, with the real Qwen3 chat template: a long tool loop stays one
segment whatever the template does to earlier turns, and its trace is exactly what the engine
generated plus the template's render of each turn's new messages."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from molt_capture import ChatRenderer, ChatRequest, Session, SessionConfig
from molt_capture.testing import ADD_TOOL, FakeGenerator, assert_token_exact, tool_call_text

QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
TOOLS = [ADD_TOOL]


@pytest.fixture
def qwen3(tokenizer):
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.chat_template = QWEN3_TEMPLATE
    return tok


def turn(session, renderer, gen, messages):
    req = ChatRequest(messages=messages, tools=TOOLS)
    raw = json.dumps(messages).encode()
    return asyncio.run(session.turn(req, raw, renderer, gen, 5.0))


def echo(result, drop_reasoning: bool = False) -> dict:
    """The reply as a client sends it back; some clients drop the reasoning."""
    msg = result.reply.as_message()
    if drop_reasoning:
        msg.pop("reasoning_content", None)
    return msg


@pytest.mark.parametrize("thinking", [True, False])
def test_ten_turn_tool_loop_is_one_segment(qwen3, thinking):
    renderer = ChatRenderer(qwen3, "qwen3", {"enable_thinking": thinking})
    think = (lambda i: f"<think>\nStep {i}: add.\n</think>\n\n") if thinking else (lambda i: "")
    # Compact JSON, which the template re-serialises with spaces; a user message midway, after
    # which the template drops every earlier turn's reasoning.
    replies = [think(i) + tool_call_text("add", {"a": i, "b": 1}, compact=True) for i in range(9)]
    gen = FakeGenerator(qwen3, [*replies, think(9) + "Done: 10."])
    s = Session("s", SessionConfig(max_len=16384))
    msgs = [{"role": "system", "content": "Add."}, {"role": "user", "content": "Count to 10."}]
    requests = []
    for i in range(10):
        requests.append(msgs)
        r = turn(s, renderer, gen, msgs)
        if i == 9:
            break
        (call,) = r.reply.tool_calls
        msgs = [
            *msgs,
            echo(r, drop_reasoning=i % 2 == 1),
            {"role": "tool", "content": str(i + 1), "tool_call_id": call.id},
        ]
        if i == 4:
            msgs.append({"role": "user", "content": "Keep going."})
    assert r.reply.content == "Done: 10."
    (seg,) = s.segments()
    assert len(seg.turns) == 10
    assert_token_exact([seg], gen.calls)
    # The trace, rebuilt from the template alone: the first request's render, then per turn
    # the generated ids, the newline closing the turn (the engine emitted <|im_end|>), and the
    # tail the template renders for the new messages (after the previous reply's tool call).
    renders = [renderer.render(m, TOOLS, add_generation_prompt=True) for m in requests]
    expected = renderer.encode(renders[0])
    end_of_reply = "</tool_call><|im_end|>\n"
    for call, render in zip(gen.calls, [*renders[1:], None], strict=True):
        expected += call.generation.token_ids + renderer.encode("\n")
        if render is not None:
            expected += renderer.encode(render[render.rindex(end_of_reply) + len(end_of_reply) :])
    assert seg.token_ids == expected
    # The template re-renders the history differently from what was generated (earlier
    # reasoning dropped, arguments re-serialised): matching renders would have split it.
    assert qwen3.decode(seg.token_ids[: seg.turns[-1].start]) != renders[-1]


def test_edited_history_still_seals(qwen3):
    renderer = ChatRenderer(qwen3, "qwen3", {"enable_thinking": False})
    gen = FakeGenerator(qwen3, [tool_call_text("add", {"a": 1, "b": 2}), "3.", "4."])
    s = Session("s", SessionConfig())
    msgs = [{"role": "user", "content": "1+2?"}]
    r = turn(s, renderer, gen, msgs)
    msgs = [
        *msgs,
        echo(r),
        {"role": "tool", "content": "3", "tool_call_id": r.reply.tool_calls[0].id},
    ]
    r2 = turn(s, renderer, gen, msgs)
    edited = [*msgs[:2], {**msgs[2], "content": "4"}, echo(r2), {"role": "user", "content": "?"}]
    turn(s, renderer, gen, edited)  # a tool result was changed: a rewrite
    assert [len(x.turns) for x in s.segments()] == [2, 1]
    assert_token_exact(s.segments(), gen.calls)


@pytest.mark.parametrize("wire", ["chat", "responses", "messages"])
def test_sdk_tool_loops_stay_one_segment_without_thinking(qwen3, wire):
    """The issue's case: enable_thinking=False, a 4-turn tool loop through each stock SDK."""
    import anthropic
    import openai

    from molt_capture import CaptureServer

    calls = [tool_call_text("add", {"a": i, "b": 1}) for i in range(4)]
    gen = FakeGenerator(qwen3, [*calls, "Done."])
    kwargs = {"enable_thinking": False}
    with CaptureServer(qwen3, gen, chat_template_kwargs=kwargs) as server:
        s = server.open_session()
        if wire == "chat":
            client = openai.OpenAI(base_url=s.base_url, api_key="k", max_retries=0)
            msgs = [{"role": "user", "content": "Count."}]
            for _ in range(5):
                r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
                message = r.choices[0].message
                msgs.append(message.model_dump(exclude_none=True))
                for c in message.tool_calls or []:
                    msgs.append({"role": "tool", "tool_call_id": c.id, "content": "1"})
        elif wire == "responses":
            client = openai.OpenAI(base_url=s.base_url, api_key="k", max_retries=0)
            tools = [{"type": "function", **ADD_TOOL["function"]}]
            items: list = [{"role": "user", "content": "Count."}]
            for _ in range(5):
                r = client.responses.create(model="m", input=items, tools=tools)
                items += [o.model_dump(exclude_none=True) for o in r.output]
                for o in r.output:
                    if o.type == "function_call":
                        items.append(
                            {"type": "function_call_output", "call_id": o.call_id, "output": "1"}
                        )
        else:
            client = anthropic.Anthropic(base_url=s.base_url, api_key="k", max_retries=0)
            tool = {"name": "add", "input_schema": ADD_TOOL["function"]["parameters"]}
            msgs = [{"role": "user", "content": "Count."}]
            for _ in range(5):
                r = client.messages.create(model="m", max_tokens=200, messages=msgs, tools=[tool])
                msgs.append({"role": "assistant", "content": r.content})
                results = [
                    {"type": "tool_result", "tool_use_id": b.id, "content": "1"}
                    for b in r.content
                    if b.type == "tool_use"
                ]
                if results:
                    msgs.append({"role": "user", "content": results})
        (seg,) = server.close_session(s.id)
    assert len(seg.turns) == 5
    assert_token_exact([seg], gen.calls)
