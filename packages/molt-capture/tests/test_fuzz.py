"""Property: malformed requests on either wire get a 4xx and never change session state."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

settings.register_profile(
    "capture", max_examples=60, deadline=None, suppress_health_check=list(HealthCheck)
)
FUZZ = settings.get_profile("capture")

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
    st.integers().map(lambda v: _set(["top_k"], v)),
    st.sampled_from(["any", "tool"]).map(lambda t: _set(["tool_choice"], {"type": t, "name": "f"})),
    not_a_string.filter(lambda v: v is not None).map(lambda v: _set(["system"], v)),
    (st.integers() | st.text(max_size=3)).map(lambda v: _set(["stop_sequences"], v)),
    st.just(_set(["tools"], [{"name": "f"}])),
)
junk = st.one_of(
    st.binary(max_size=40).filter(lambda b: not _is_json_object(b)),
    json_values.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode()),
    st.dictionaries(
        st.text(max_size=8).filter(lambda k: k != "messages"), json_values, max_size=4
    ).map(lambda d: json.dumps(d).encode()),
)


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


@pytest.fixture
def warm_session(server):
    """A session that already holds one recorded turn, so there is state to disturb."""
    s = server.open_session()
    r = httpx.post(f"{server.base_url(s.id)}/chat/completions", json=OPENAI_BASE)
    assert r.status_code == 200
    yield s
    server.close_session(s.id)


def _check(server, session, route: str, raw: bytes) -> None:
    before, n_calls = _state(server, session), len(server.generator.calls)
    r = httpx.post(
        f"{server.base_url(session.id)}/{route}",
        content=raw,
        headers={"content-type": "application/json"},
    )
    assert 400 <= r.status_code < 500, (r.status_code, raw, r.text)
    assert "Traceback" not in r.text and r.json()  # a JSON error body, never a stack trace
    assert _state(server, session) == before and len(server.generator.calls) == n_calls


@FUZZ
@given(mutate=openai_mutations)
def test_openai_malformed_requests(server, warm_session, mutate):
    _check(server, warm_session, "chat/completions", json.dumps(mutate(OPENAI_BASE)).encode())


@FUZZ
@given(mutate=anthropic_mutations)
def test_anthropic_malformed_requests(server, warm_session, mutate):
    _check(server, warm_session, "v1/messages", json.dumps(mutate(ANTHROPIC_BASE)).encode())


@FUZZ
@given(
    raw=junk, route=st.sampled_from(["chat/completions", "v1/messages", "v1/messages/count_tokens"])
)
def test_junk_bodies(server, warm_session, raw, route):
    _check(server, warm_session, route, raw)
