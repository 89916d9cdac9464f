"""HTTP surface: routes, errors, security, timeouts, per-session serialisation."""

from __future__ import annotations

import asyncio
import threading
import time

import anthropic
import httpx
import openai
import pytest

from molt_capture import CaptureServer
from molt_capture.testing import FakeGenerator

USER_MSG = {"role": "user", "content": "What is 1+2?"}


def openai_client(session, **kw) -> openai.OpenAI:
    """A stock client pointed at the session, as an agent would build it."""
    kw = {"api_key": "any", "max_retries": 0, **kw}
    return openai.OpenAI(base_url=session.base_url, **kw)


def anthropic_client(session, **kw) -> anthropic.Anthropic:
    """A stock client pointed at the session, as an agent would build it."""
    kw = {"api_key": "any", "max_retries": 0, **kw}
    return anthropic.Anthropic(base_url=session.base_url, **kw)


def test_health_and_both_base_url_forms(server):
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    s = server.open_session()
    assert s.base_url == f"http://127.0.0.1:{server.port}/s/{s.id}"
    conventional = openai.OpenAI(base_url=s.base_url + "/v1", api_key="k", max_retries=0)
    assert (
        conventional.chat.completions.create(model="m", messages=[USER_MSG])
        .choices[0]
        .message.content
        == "Hello!"
    )
    assert [m.id for m in anthropic_client(s).models.list()] == [server.model_name]
    server.close_session(s.id)


def test_session_ids_are_unguessable(server):
    ids = [server.open_session().id for _ in range(50)]
    assert len(set(ids)) == 50 and min(len(i) for i in ids) >= 32  # 192 bits, url-safe base64
    for i in ids:
        server.close_session(i)


@pytest.mark.parametrize("route", ["chat/completions", "v1/messages"])
def test_unknown_session_and_bad_json(server, route):
    r = httpx.post(f"{server.url}/s/nope/{route}", json={"messages": []})
    assert r.status_code == 404 and "unknown session" in r.text
    s = server.open_session()
    for body in (b"{not json", b"[1, 2]", b""):
        r = httpx.post(f"{server.base_url(s.id)}/{route}", content=body)
        assert r.status_code == 400 and "Traceback" not in r.text
    r = httpx.post(
        f"{server.base_url(s.id)}/{route}",
        json={"messages": [{"role": "user", "content": 5}], "max_tokens": 3},
    )
    assert r.status_code == 400 and "messages.0.content" in r.text
    server.close_session(s.id)


def test_port_in_use_fails_fast(tokenizer, server):
    with pytest.raises(RuntimeError, match="did not start"):
        CaptureServer(tokenizer, server.generator, port=server.port).start(timeout_s=5)


def test_bearer_token(tokenizer):
    gen = FakeGenerator(tokenizer)
    with pytest.raises(ValueError, match="api_key"):
        CaptureServer(tokenizer, gen, host="0.0.0.0")
    with CaptureServer(tokenizer, gen, api_key="secret") as server:
        s = server.open_session()
        with pytest.raises(openai.AuthenticationError):
            openai_client(s).chat.completions.create(model="m", messages=[USER_MSG])
        ok = openai.OpenAI(base_url=server.base_url(s.id), api_key="secret", max_retries=0)
        assert ok.chat.completions.create(model="m", messages=[USER_MSG]).choices[0].message.content
        anthropic_ok = anthropic_client(s, api_key="secret")  # sends x-api-key
        assert anthropic_ok.messages.create(model="m", max_tokens=9, messages=[USER_MSG]).content
        assert server.host == "127.0.0.1"


def test_timeout_and_strict_temperature(tokenizer):
    gen = FakeGenerator(tokenizer, delay_s=0.5)
    with CaptureServer(tokenizer, gen, generator_timeout_s=0.05, strict_temperature=True) as server:
        s = server.open_session(temperature=0.8)
        client = openai_client(s)
        with pytest.raises(openai.InternalServerError, match="timed out") as e:
            client.chat.completions.create(model="m", messages=[USER_MSG])
        assert e.value.status_code == 504
        with pytest.raises(openai.BadRequestError, match="training temperature"):
            client.chat.completions.create(model="m", messages=[USER_MSG], temperature=1.0)
        assert server.close_session(s.id) == []


def test_turns_of_one_session_are_serialised(tokenizer):
    active, peak = 0, 0
    fake = FakeGenerator(tokenizer, ["Hi."])

    async def generator(ids, params, sid):
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.05)
        active -= 1
        return await fake(ids, params, sid)

    with CaptureServer(tokenizer, generator) as server:
        s = server.open_session()

        async def burst():
            client = openai.AsyncOpenAI(base_url=server.base_url(s.id), api_key="k", max_retries=0)
            await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": f"q{i}"}]
                    )
                    for i in range(4)
                )
            )
            await client.close()

        asyncio.run(burst())
    assert peak == 1 and len(fake.calls) == 4


def test_full_context_answers_length_on_both_wires(server):
    server.generator.set_replies(["word " * 100])
    prompt = server.renderer.render([USER_MSG], None, add_generation_prompt=True)
    s = server.open_session(max_len=len(server.renderer.encode(prompt)) + 8)
    r = openai_client(s).chat.completions.create(model="m", messages=[USER_MSG], max_tokens=500)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    follow_up = [
        USER_MSG,
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "more"},
    ]
    r = openai_client(s).chat.completions.create(model="m", messages=follow_up)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 0
    anthropic_messages = [{"role": m["role"], "content": m["content"]} for m in follow_up]
    a = anthropic_client(s).messages.create(model="m", max_tokens=50, messages=anthropic_messages)
    assert a.stop_reason == "max_tokens" and a.usage.output_tokens == 0
    (segment,) = server.close_session(s.id)
    assert segment.truncated and len(segment) == segment.turns[0].end


def test_close_waits_for_a_turn_in_flight(server):
    gen = server.generator
    gen.set_replies(["Late."])
    gen.hold_until_concurrent(2)  # the turn's one engine call waits until `gate` is cleared
    s = server.open_session()
    reply, closed = [], []
    request = threading.Thread(
        target=lambda: reply.append(
            openai_client(s).chat.completions.create(model="m", messages=[USER_MSG])
        )
    )
    request.start()
    while gen.in_flight == 0:  # the turn is in its engine call, holding the session's lock
        time.sleep(0.005)
    closing = threading.Thread(target=lambda: closed.append(server.close_session(s.id)))
    closing.start()
    while s.id in server.sessions:  # the close has begun: it forgets the session first
        time.sleep(0.005)
    gen.gate = 0  # the engine answers; the close must wait for the turn to commit
    closing.join()
    request.join()
    (segment,) = closed[0]
    assert len(segment.turns) == 1 and reply[0].choices[0].message.content == "Late."
    with pytest.raises(openai.NotFoundError):
        openai_client(s).chat.completions.create(model="m", messages=[USER_MSG])
