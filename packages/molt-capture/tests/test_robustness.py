"""No client can hurt the server: limits, error shapes on every route, refusals alike on every
wire, no 5xx for client input, and the reply text a stray token must not swallow."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from molt_capture import CaptureServer
from molt_capture.errors import ParamRejected
from molt_capture.testing import ADD_TOOL, ADD_TOOL_ANTHROPIC, FakeGenerator, tool_call_text

USER = {"role": "user", "content": "What is 1+2?"}
# One minimal valid body per wire, by route.
BODIES = {
    "chat/completions": {"model": "m", "messages": [USER]},
    "responses": {"model": "m", "input": "What is 1+2?"},
    "v1/messages": {"model": "m", "max_tokens": 200, "messages": [USER]},
}
# Where each wire puts the same thing.
TOOLS = {
    "chat/completions": [ADD_TOOL],
    "responses": [{"type": "function", **ADD_TOOL["function"]}],
}
TOOLS["v1/messages"] = [ADD_TOOL_ANTHROPIC]


def post(server, session, route: str, body: dict | bytes, **kw) -> httpx.Response:
    url = f"{server.base_url(session.id)}/{route}"
    if isinstance(body, bytes):
        return httpx.post(url, content=body, **kw)
    return httpx.post(url, json=body, **kw)


def assert_wire_error(route: str, r: httpx.Response, status: int, text: str = "") -> None:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    if route.startswith("v1/messages"):
        assert body["type"] == "error" and text in body["error"]["message"]
    else:
        assert text in body["error"]["message"] and body["error"]["code"] == status


@pytest.mark.parametrize("route", list(BODIES))
def test_request_size_limit_is_413_in_the_wire_shape(tokenizer, route):
    with CaptureServer(tokenizer, FakeGenerator(tokenizer), max_request_bytes=4096) as server:
        s = server.open_session()
        big = {**BODIES[route], "padding": "x" * 5000}
        assert_wire_error(route, post(server, s, route, big), 413, "max_request_bytes")
        if route == "v1/messages":  # the Anthropic SDK's error type for it
            assert post(server, s, route, big).json()["error"]["type"] == "request_too_large"

        def chunks():  # no content-length: the limit holds while streaming the body in
            yield json.dumps(big).encode()

        r = httpx.post(f"{server.base_url(s.id)}/{route}", content=chunks())
        assert_wire_error(route, r, 413, "max_request_bytes")
        assert post(server, s, route, BODIES[route]).status_code == 200


def test_unknown_routes_and_methods_answer_in_the_wire_shape(server):
    s = server.open_session()
    with pytest.raises(openai.NotFoundError, match="no such route"):
        openai.OpenAI(base_url=s.base_url, api_key="k", max_retries=0).embeddings.create(
            model="m", input="x"
        )
    with pytest.raises(anthropic.NotFoundError, match="no such route"):
        anthropic.Anthropic(
            base_url=s.base_url + "/nowhere", api_key="k", max_retries=0
        ).messages.create(model="m", max_tokens=5, messages=[USER])
    r = httpx.get(f"{server.base_url(s.id)}/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"].startswith("method not allowed")
    r = httpx.get(f"{server.base_url(s.id)}/v1/messages", headers={"anthropic-version": "1"})
    assert r.status_code == 405 and r.json()["type"] == "error"
    server.close_session(s.id)


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize("depth", [50, 300, 5000])
def test_deeply_nested_tool_arguments_never_5xx(server, depth):
    s = server.open_session()
    args = "{" + '"a":{' * depth + "}" * depth + "}"
    chat = [
        USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "add", "arguments": args}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "3"},
    ]
    items = [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c", "name": "add", "arguments": args},
        {"type": "function_call_output", "call_id": "c", "output": "3"},
    ]
    bodies = {
        "chat/completions": {**BODIES["chat/completions"], "messages": chat},
        "responses": {"model": "m", "input": items},
    }
    for route, body in bodies.items():
        assert post(server, s, route, body).status_code < 500
    raw = (
        '{"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}, '
        '{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "add", '
        '"input": ' + args + "}]}]}"
    )
    assert post(server, s, "v1/messages", raw.encode()).status_code < 500
    server.close_session(s.id)


@pytest.mark.parametrize("route", list(BODIES))
def test_engine_refusal_is_400_naming_the_field(server, gen, route):
    s = server.open_session()
    gen.fail_next = ParamRejected("stop", "stop strings must be shorter")
    r = post(server, s, route, BODIES[route])
    name = {"v1/messages": "stop_sequences"}.get(route, "stop")
    assert_wire_error(route, r, 400, f"the engine refused {name}")
    gen.fail_next = ParamRejected("max_tokens", "too many")
    name = {"v1/messages": "max_tokens", "responses": "max_output_tokens"}.get(route, "max_tokens")
    assert_wire_error(route, post(server, s, route, BODIES[route]), 400, name)
    assert server.close_session(s.id) == []


def test_tool_results_must_answer_a_call(server):
    s = server.open_session()
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
    cases = {
        "chat/completions": [
            ([USER, {"role": "tool", "tool_call_id": "c1", "content": "3"}], "must follow"),
            ([USER, assistant, {"role": "tool", "tool_call_id": "c2", "content": "3"}], "'c2'"),
        ],
        "v1/messages": [
            (
                [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
                "must follow",
            ),
            (
                [
                    USER,
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t1", "name": "add", "input": {}}],
                    },
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2"}]},
                ],
                "'t2'",
            ),
        ],
    }
    for route, bodies in cases.items():
        for messages, text in bodies:
            r = post(server, s, route, {**BODIES[route], "messages": messages})
            assert_wire_error(route, r, 400, text)
    server.close_session(s.id)


# The same unsupported request on every wire, in each wire's terms.
REFUSED = {
    "sampling": {
        "chat/completions": {"logit_bias": {"5": 10}},
        "responses": {"top_k": 5},
        "v1/messages": {"top_k": 5},
    },
    "structured output": {
        "chat/completions": {"response_format": {"type": "json_object"}},
        "responses": {"text": {"format": {"type": "json_object"}}},
        "v1/messages": {"output_format": {"type": "json_schema", "schema": {}}},
    },
    "forced tool choice": {
        "chat/completions": {"tool_choice": "required"},
        "responses": {"tool_choice": "required"},
        "v1/messages": {"tool_choice": {"type": "any"}},
    },
    "image": {
        "chat/completions": {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}
            ]
        },
        "responses": {
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]
        },
        "v1/messages": {
            "messages": [
                {"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}
            ]
        },
    },
}


@pytest.mark.parametrize("kind", list(REFUSED))
@pytest.mark.parametrize("route", list(BODIES))
def test_unsupported_requests_are_refused_alike(server, gen, kind, route):
    s = server.open_session()
    body = {**BODIES[route], "tools": TOOLS[route], **REFUSED[kind][route]}
    r = post(server, s, route, body)
    expected = {
        "sampling": "not supported",
        "structured output": "structured output",
        "forced tool choice": "tool_choice",
        "image": "needs a multimodal model",
    }[kind]
    assert_wire_error(route, r, 400, expected)
    assert gen.calls_for(s.id) == []
    server.close_session(s.id)


@pytest.mark.parametrize(
    ("text", "content", "reasoning"),
    [
        ("Hello<|endoftext|>world", "Hello\n\nworld", None),
        ("<think>\na\n</think>\n\nx<think>\nb\n</think>\n\ny", "x\n\ny", "a\n\nb"),
        ("pre<|endoftext|>" + tool_call_text("add", {"a": 1}), "pre", None),
        ("stray <|im_start|> token", "stray  token", None),
    ],
)
def test_reply_text_around_stray_tokens_reaches_the_agent(server, gen, text, content, reasoning):
    gen.set_replies([text])
    s = server.open_session()
    r = openai.OpenAI(base_url=s.base_url, api_key="k", max_retries=0).chat.completions.create(
        model="m", messages=[USER], tools=[ADD_TOOL]
    )
    message = r.choices[0].message
    assert message.content == content
    assert (message.model_extra or {}).get("reasoning_content") == reasoning
    server.close_session(s.id)


@pytest.mark.parametrize("route", list(BODIES))
def test_tool_arguments_strict_json_cannot_carry_are_text(server, gen, route):
    """Python's JSON parser accepts NaN; a reply carrying it would be invalid JSON (and
    Starlette refuses to render it: a 500 after the engine answered)."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": NaN}}\n</tool_call>'
    gen.set_replies([call])
    s = server.open_session()
    r = post(server, s, route, {**BODIES[route], "tools": TOOLS[route]})
    assert r.status_code == 200 and "NaN" in r.text and "tool_use" not in r.text
    server.close_session(s.id)


@pytest.mark.parametrize("route", list(BODIES))
def test_numbers_no_reply_could_carry_are_refused(server, gen, route):
    """NaN / Infinity literals are not JSON; 1e400 parses as infinity. Either in a tool schema
    (which the Responses wire echoes) must be a 400, never a 500 after generating."""
    s = server.open_session()
    body = json.dumps({**BODIES[route], "tools": TOOLS[route]})
    for number in ("NaN", "Infinity", "1e400"):
        raw = body.replace('"integer"}', '"integer", "maximum": ' + number + "}", 1).encode()
        assert number.encode() in raw
        r = post(server, s, route, raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (number, r.text)
    assert gen.calls_for(s.id) == []
    server.close_session(s.id)
