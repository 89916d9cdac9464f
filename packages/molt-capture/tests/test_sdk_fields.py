"""Nothing an SDK asks for is silently ignored: every top-level request field of the installed
SDKs' own request types is served, ignored on purpose or refused by its wire (a field a new SDK
adds fails here until it is classified), and each refused field, sent through the real SDK
client, gets a 400 naming it without reaching the engine."""

from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pydantic
import pytest
from anthropic.types.message_create_params import MessageCreateParamsNonStreaming
from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming
from openai.types.responses.response_create_params import ResponseCreateParamsNonStreaming

from molt_capture import anthropic_wire, openai_wire, responses_wire

USER = {"role": "user", "content": "What is 1+2?"}
# Per wire: the SDK's request type, the wire's request model, its route and a minimal body.
WIRES = {
    "chat": (
        CompletionCreateParamsNonStreaming,
        openai_wire.CompletionRequest,
        "chat/completions",
        {"model": "m", "messages": [USER]},
    ),
    "responses": (
        ResponseCreateParamsNonStreaming,
        responses_wire.ResponsesRequest,
        "responses",
        {"model": "m", "input": "What is 1+2?"},
    ),
    "messages": (
        MessageCreateParamsNonStreaming,
        anthropic_wire.MessagesRequest,
        "v1/messages",
        {"model": "m", "max_tokens": 16, "messages": [USER]},
    ),
}
SCHEMA = {"type": "object", "properties": {"value": {"type": "integer"}}}
# A value each refused field is refused with, as a client would send it (its no-ops pass).
REFUSING = {
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.2,
    "logit_bias": {"5": 10},
    "top_k": 20,
    "min_p": 0.1,
    "n": 2,
    "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    "functions": [{"name": "add", "parameters": SCHEMA}],
    "function_call": {"name": "add"},
    "modalities": ["text", "audio"],
    "web_search_options": {},
    "text.format": {"type": "json_schema", "name": "a", "schema": SCHEMA},
    "background": True,
    "conversation": "conv_1",
    "prompt": {"id": "pmpt_1"},
    "context_management": [{"type": "compaction", "compact_threshold": 1000}],
    "output_config.format": {"type": "json_schema", "schema": SCHEMA},
    "output_format": {"type": "json_schema", "schema": SCHEMA},
}


class Answer(pydantic.BaseModel):
    value: int


def sdk_fields(wire: str) -> set[str]:
    params = WIRES[wire][0]
    return set(params.__required_keys__ | params.__optional_keys__)


def create(wire: str, session, **kw):
    """One request through the stock SDK client, as an agent would send it."""
    if wire == "messages":
        client = anthropic.Anthropic(base_url=session.base_url, api_key="k", max_retries=0)
        return client.messages.create(model="m", max_tokens=16, messages=[USER], **kw)
    client = openai.OpenAI(base_url=session.base_url, api_key="k", max_retries=0)
    if wire == "responses":
        return client.responses.create(model="m", input="What is 1+2?", **kw)
    return client.chat.completions.create(model="m", messages=[USER], **kw)


@pytest.mark.parametrize("wire", list(WIRES))
def test_every_sdk_request_field_is_classified_once(wire):
    model = WIRES[wire][1]
    classes = {
        "served": set(model.model_fields),
        "ignored": set(model.IGNORED),
        "refused": {path.split(".")[0] for path in model.REFUSED},
    }
    assert "stream" in sdk_fields(wire)  # the request type read is the whole request
    for name in sorted(sdk_fields(wire)):
        where = [kind for kind, names in classes.items() if name in names]
        assert len(where) == 1, f"{wire} request field {name!r} is {where or 'not classified'}"
    assert not classes["ignored"] & (classes["served"] | classes["refused"])


@pytest.mark.parametrize(
    ("wire", "path"), [(wire, path) for wire, spec in WIRES.items() for path in spec[1].REFUSED]
)
def test_each_refused_field_gets_a_400_naming_it(server, gen, wire, path):
    top, *inner = path.split(".")
    value = REFUSING[path]
    for key in reversed(inner):
        value = {key: value}
    # A field the SDK has is passed as the SDK's own argument; others (vLLM extras, an older
    # name) as a client passes them, through `extra_body`.
    kw = {top: value} if top in sdk_fields(wire) else {"extra_body": {top: value}}
    s = server.open_session()
    error = anthropic.BadRequestError if wire == "messages" else openai.BadRequestError
    with pytest.raises(error, match=re.escape(f"{path}: ")):
        create(wire, s, **kw)
    assert gen.calls_for(s.id) == []
    server.close_session(s.id)


@pytest.mark.parametrize("wire", list(WIRES))
def test_ignored_fields_are_served_as_if_absent(server, gen, wire):
    _, model, route, body = WIRES[wire]
    s = server.open_session()
    url = f"{server.base_url(s.id)}/{route}"
    r = httpx.post(url, json={**body, **dict.fromkeys(model.IGNORED, "x")})
    assert r.status_code == 200, r.text
    assert len(gen.calls_for(s.id)) == 1
    server.close_session(s.id)


def test_the_sdks_structured_output_helpers_are_refused(server, gen):
    s = server.open_session()
    claude = anthropic.Anthropic(base_url=s.base_url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="output_config.format: structured output"):
        claude.messages.parse(model="m", max_tokens=16, messages=[USER], output_format=Answer)
    oai = openai.OpenAI(base_url=s.base_url, api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="response_format: structured output"):
        oai.chat.completions.parse(model="m", messages=[USER], response_format=Answer)
    with pytest.raises(openai.BadRequestError, match="text.format: structured output"):
        oai.responses.parse(model="m", input="What is 1+2?", text_format=Answer)
    assert gen.calls_for(s.id) == []
    # The effort part of `output_config` is harmless: ignored, the turn is served.
    r = claude.messages.create(
        model="m", max_tokens=16, messages=[USER], output_config={"effort": "low"}
    )
    assert r.content[0].text == "Hello!"
    server.close_session(s.id)
