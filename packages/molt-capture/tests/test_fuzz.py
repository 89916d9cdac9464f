"""Seeded fuzz: malformed requests on every wire (wrong types and ranges, nesting, sizes,
encodings, orders of messages) all get a 4xx in the wire's error shape, never change any
session's state or reach the engine, and leave the server serving. 1,000 requests per wire."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from molt_capture.wire import SAMPLING_REFUSED

PER_WIRE = 1000
FUZZ = settings(
    max_examples=PER_WIRE,
    deadline=None,
    derandomize=True,  # the same requests on every run and in CI
    database=None,
    suppress_health_check=list(HealthCheck),
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
not_a_string = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
)
not_a_number = (
    st.text(max_size=5) | st.lists(st.integers(), max_size=2) | st.none().map(lambda _: {})
)
finite = {"allow_nan": False, "allow_infinity": False}

OPENAI_BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ANTHROPIC_BASE = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES_BASE = {"model": "m", "input": [{"role": "user", "content": "hi"}]}
ASSISTANT_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}


def _set(path: list, value):
    def apply(body: dict) -> dict:
        body = copy.deepcopy(body)
        target = body
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return body

    return apply


def _drop(key: str):
    return lambda body: {k: v for k, v in body.items() if k != key}


# Each strategy yields a function turning the valid base body into a surely-invalid one.
openai_mutations = st.one_of(
    st.just(_drop("messages")),
    st.sampled_from([[], "hi", 3, None]).map(lambda v: _set(["messages"], v)),
    st.text(max_size=10)
    .filter(lambda r: r not in {"system", "developer", "user", "assistant", "tool"})
    .map(lambda v: _set(["messages", 0, "role"], v)),
    not_a_string.map(lambda v: _set(["messages", 0, "content"], v)),
    (
        st.floats(max_value=-0.001, **finite) | st.floats(min_value=2.001, **finite) | not_a_number
    ).map(lambda v: _set(["temperature"], v)),
    (st.floats(max_value=0.0, **finite) | st.floats(min_value=1.001, **finite)).map(
        lambda v: _set(["top_p"], v)
    ),
    (st.integers(max_value=0) | st.floats(**finite) | st.text(max_size=3)).map(
        lambda v: _set(["max_tokens"], v)
    ),
    st.integers(min_value=2).map(lambda v: _set(["n"], v)),
    (st.integers() | st.lists(st.integers(), min_size=1, max_size=2)).map(
        lambda v: _set(["stop"], v)
    ),
    (st.integers() | st.text(max_size=3) | st.just([{"type": "function"}])).map(
        lambda v: _set(["tools"], v)
    ),
    (st.integers() | st.text(max_size=3)).map(lambda v: _set(["stream"], v)),
    st.just(_set(["messages"], [{"role": "tool", "content": "3"}])),
    st.text(max_size=6)
    .filter(lambda s: not s.strip().startswith("{"))
    .map(
        lambda a: _set(
            ["messages"],
            [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": a}}
                    ],
                }
            ],
        )
    ),
    st.sampled_from(["required", {"type": "function", "function": {"name": "f"}}]).map(
        lambda v: _set(["tool_choice"], v)
    ),
    # Orders: a tool result answering no call, or another call's id.
    st.text(max_size=6)
    .filter(lambda i: i != "c1")
    .map(
        lambda i: _set(
            ["messages"],
            [
                {"role": "user", "content": "hi"},
                ASSISTANT_CALL,
                {"role": "tool", "tool_call_id": i, "content": "3"},
            ],
        )
    ),
    st.just(
        _set(
            ["messages"],
            [
                {"role": "user", "content": "hi"},
                ASSISTANT_CALL,
                {"role": "user", "content": "hi"},
                {"role": "tool", "tool_call_id": "c1", "content": "3"},
            ],
        )
    ),
    st.sampled_from(["image_url", "input_audio", "file"]).map(
        lambda t: _set(["messages", 0, "content"], [{"type": t, t: {}}])
    ),
    st.sampled_from(list(SAMPLING_REFUSED)).map(lambda k: _set([k], 0.5)),
)
anthropic_mutations = st.one_of(
    st.sampled_from(["max_tokens", "messages"]).map(_drop),
    (st.integers(max_value=0) | st.text(max_size=3) | st.floats(**finite)).map(
        lambda v: _set(["max_tokens"], v)
    ),
    st.text(max_size=10)
    .filter(lambda r: r not in {"user", "assistant"})
    .map(lambda v: _set(["messages", 0, "role"], v)),
    not_a_string.filter(lambda v: not isinstance(v, list)).map(
        lambda v: _set(["messages", 0, "content"], v)
    ),
    st.text(max_size=8)
    .filter(lambda t: t not in {"text", "thinking", "redacted_thinking", "tool_use", "tool_result"})
    .map(lambda t: _set(["messages", 0, "content"], [{"type": t, "text": "x"}])),
    st.just(
        _set(
            ["messages"],
            [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}],
        )
    ),
    st.just(
        _set(
            ["messages"],
            [
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}],
                }
            ],
        )
    ),
    (
        st.floats(min_value=1.001, **finite) | st.floats(max_value=-0.001, **finite) | not_a_number
    ).map(lambda v: _set(["temperature"], v)),
    st.integers().filter(lambda k: k not in (-1, 0)).map(lambda v: _set(["top_k"], v)),
    st.sampled_from(["any", "tool"]).map(lambda t: _set(["tool_choice"], {"type": t, "name": "f"})),
    not_a_string.filter(lambda v: v is not None).map(lambda v: _set(["system"], v)),
    (st.integers() | st.text(max_size=3)).map(lambda v: _set(["stop_sequences"], v)),
    st.just(_set(["tools"], [{"name": "f"}])),
    st.text(max_size=6)
    .filter(lambda i: i != "t1")
    .map(
        lambda i: _set(
            ["messages"],
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [TOOL_USE]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i}]},
            ],
        )
    ),
    st.just(
        _set(
            ["messages"],
            [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}],
        )
    ),
    st.sampled_from(["image", "document"]).map(
        lambda t: _set(["messages", 0, "content"], [{"type": t, "source": {}}])
    ),
    st.just(_set(["output_format"], {"type": "json_schema", "schema": {}})),
)
ITEM_TYPES = {"message", "function_call", "function_call_output", "reasoning"}
FUNCTION_CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
responses_mutations = st.one_of(
    st.just(_drop("input")),
    st.sampled_from([[], None, 3, {}, True]).map(lambda v: _set(["input"], v)),
    st.text(max_size=10)
    .filter(lambda t: t not in ITEM_TYPES)
    .map(lambda t: _set(["input", 0], {"type": t, "role": "user", "content": "hi"})),
    st.text(max_size=10)
    .filter(lambda r: r not in {"user", "system", "developer", "assistant"})
    .map(lambda v: _set(["input", 0, "role"], v)),
    not_a_string.filter(lambda v: not isinstance(v, list)).map(
        lambda v: _set(["input", 0, "content"], v)
    ),
    st.text(max_size=10)
    .filter(lambda t: t not in {"input_text", "output_text"})
    .map(lambda t: _set(["input", 0, "content"], [{"type": t, "text": "x"}])),
    not_a_string.map(lambda v: _set(["input", 0], {**FUNCTION_CALL, "call_id": v})),
    st.text(max_size=6)
    .filter(lambda a: not a.strip().startswith("{"))
    .map(lambda a: _set(["input", 0], {**FUNCTION_CALL, "arguments": a})),
    # Orders: an output answering no call, or another call's id; a bare reasoning summary type.
    st.just(_set(["input"], [{"type": "function_call_output", "call_id": "c1", "output": "3"}])),
    st.text(max_size=6)
    .filter(lambda i: i != "c1")
    .map(
        lambda i: _set(
            ["input"],
            [FUNCTION_CALL, {"type": "function_call_output", "call_id": i, "output": "3"}],
        )
    ),
    st.just(_set(["input", 0], {"type": "reasoning", "summary": [{"type": "x", "text": "y"}]})),
    (
        st.floats(max_value=-0.001, **finite) | st.floats(min_value=2.001, **finite) | not_a_number
    ).map(lambda v: _set(["temperature"], v)),
    (st.floats(max_value=0.0, **finite) | st.floats(min_value=1.001, **finite)).map(
        lambda v: _set(["top_p"], v)
    ),
    (st.integers(max_value=0) | st.floats(**finite) | st.text(max_size=3)).map(
        lambda v: _set(["max_output_tokens"], v)
    ),
    st.text(max_size=10).map(lambda v: _set(["previous_response_id"], "resp_" + v)),
    st.text(max_size=10)
    .filter(lambda t: t != "function")
    .map(lambda t: _set(["tools"], [{"type": t, "name": "f"}])),
    st.just(_set(["tools"], [{"type": "function"}])),
    st.sampled_from(["required", {"type": "function", "name": "f"}]).map(
        lambda v: _set(["tool_choice"], v)
    ),
    st.sampled_from(["json_object", "json_schema"]).map(
        lambda t: _set(["text"], {"format": {"type": t}})
    ),
    st.sampled_from(["background", "conversation", "prompt"]).map(lambda k: _set([k], True)),
    st.sampled_from(["input_image", "input_file", "input_audio"]).map(
        lambda t: _set(["input", 0, "content"], [{"type": t}])
    ),
    st.sampled_from(list(SAMPLING_REFUSED)).map(lambda k: _set([k], 0.5)),
    (st.integers() | st.text(max_size=3)).map(lambda v: _set(["stream"], v)),
)


def _nest(base: dict, key: str, depth: int) -> bytes:
    """`base` with `key`'s value inside `depth` lists (as text: json.dumps would recurse)."""
    nested = "[" * depth + json.dumps(base[key]) + "]" * depth
    rest = json.dumps({k: v for k, v in base.items() if k != key})
    return (rest[:-1] + f', "{key}": {nested}}}').encode()


def damaged(base: dict, key: str):
    """Any wire's valid body made surely invalid as bytes: bad encodings, truncation, deep
    nesting, oversized wrong values, a long conversation with one bad message at the end."""
    raw = json.dumps(base).encode()
    return st.one_of(
        st.tuples(
            st.integers(0, len(raw)), st.sampled_from([b"\xff", b"\xc0", b"\x80", b"\xfe"])
        ).map(lambda t: raw[: t[0]] + t[1] + raw[t[0] :]),
        st.integers(1, len(raw) - 1).map(lambda n: raw[:n]),
        st.sampled_from(["\\ud800", "\\udfff", "\\ud83d x"]).map(
            lambda u: raw.replace(b'"hi"', f'"{u}"'.encode())
        ),
        st.sampled_from(["NaN", "Infinity", "-Infinity"]).map(
            lambda n: raw.replace(b'"hi"', n.encode())
        ),
        st.sampled_from(["utf-16", "utf-32", "utf-8-sig"]).map(
            lambda enc: json.dumps(base).encode(enc)
        ),
        st.integers(2, 3000).map(lambda d: _nest(base, key, d)),
        st.integers(10_000, 200_000).map(
            lambda n: json.dumps({**base, key: [{"role": "x" * n, "content": "hi"}]}).encode()
        ),
        st.integers(100, 2000).map(
            lambda n: json.dumps(
                {**base, key: [{"role": "user", "content": "hi"}] * n + [{"role": 7}]}
            ).encode()
        ),
    )


junk = st.one_of(
    st.binary(max_size=40).filter(lambda b: not _is_json_object(b)),
    json_values.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode()),
    st.dictionaries(
        st.text(max_size=8).filter(lambda k: k != "messages"), json_values, max_size=4
    ).map(lambda d: json.dumps(d).encode()),
)


TOOL_USE = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except (ValueError, UnicodeDecodeError):
        return False


def _state(server, session) -> str:
    s = server.sessions[session.id]
    segs = [x.to_dict() for x in s.segments()]
    return json.dumps(
        [segs, repr(s._history), list(s.responses), s._last_key.hex() if s._last_key else None]
    )


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=30) as client:
        yield client


@pytest.fixture
def warm_session(server, http):
    """A session that already holds recorded turns on two wires, so there is state to disturb."""
    s = server.open_session()
    for route, body in (("chat/completions", OPENAI_BASE), ("responses", RESPONSES_BASE)):
        assert http.post(f"{server.base_url(s.id)}/{route}", json=body).status_code == 200
    yield s
    server.close_session(s.id)


def _check(server, http, session, route: str, raw: bytes) -> None:
    before, n_calls = _state(server, session), len(server.generator.calls)
    r = http.post(
        f"{server.base_url(session.id)}/{route}",
        content=raw,
        headers={"content-type": "application/json"},
    )
    assert 400 <= r.status_code < 500, (r.status_code, raw[:300], r.text[:300])
    body = r.json()  # a JSON error body in the wire's shape, never a stack trace
    assert body["type"] == "error" if route.startswith("v1/messages") else body["error"]["message"]
    assert "Traceback" not in r.text
    assert _state(server, session) == before and len(server.generator.calls) == n_calls


def _bodies(base: dict, key: str, mutations):
    return mutations.map(lambda mutate: json.dumps(mutate(base)).encode()) | damaged(base, key)


@FUZZ
@given(raw=_bodies(OPENAI_BASE, "messages", openai_mutations))
def test_openai_malformed_requests(server, http, warm_session, raw):
    _check(server, http, warm_session, "chat/completions", raw)


@FUZZ
@given(raw=_bodies(ANTHROPIC_BASE, "messages", anthropic_mutations))
def test_anthropic_malformed_requests(server, http, warm_session, raw):
    _check(server, http, warm_session, "v1/messages", raw)


@FUZZ
@given(raw=_bodies(RESPONSES_BASE, "input", responses_mutations))
def test_responses_malformed_requests(server, http, warm_session, raw):
    _check(server, http, warm_session, "responses", raw)


@settings(FUZZ, max_examples=300)
@given(
    raw=junk,
    route=st.sampled_from(
        ["chat/completions", "responses", "v1/messages", "v1/messages/count_tokens"]
    ),
)
def test_junk_bodies(server, http, warm_session, raw, route):
    _check(server, http, warm_session, route, raw)


def test_still_serving_after_the_fuzz(server, http, warm_session):
    """Runs after the fuzz (same server): a valid follow-up on each wire extends its trace."""
    base = server.base_url(warm_session.id)
    before = sum(len(s.turns) for s in warm_session.segments())
    for route, body in (
        ("chat/completions", OPENAI_BASE),
        ("v1/messages", ANTHROPIC_BASE),
        ("responses", {**RESPONSES_BASE, "input": "again"}),
    ):
        assert http.post(f"{base}/{route}", json=body).status_code == 200
    assert sum(len(s.turns) for s in warm_session.segments()) == before + 3
