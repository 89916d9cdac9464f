"""Shared fixtures: a scripted fake of vLLM's token-in/token-out engine on a loopback port.

The fake serves the two routes the token client uses, `GET /weight_info` and
`POST /inference/v1/generate`, with replies shaped like vLLM's (token ids, per-token log-prob
entries, finish and stop reason, weight-version spans over output tokens). Each test scripts its
failures; real engines are exercised in tests_integration/test_engines.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

GENERATE = "/inference/v1/generate"
WEIGHT_INFO = "/weight_info"


@dataclass
class Call:
    method: str
    path: str
    headers: dict[str, str]
    body: dict | None


class DroppedConnection(Response):
    """Sends the status line and part of the body, then fails: uvicorn closes the socket
    mid-response, which the client sees as a transport error."""

    async def __call__(self, scope, receive, send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"512")],
            }
        )
        await send({"type": "http.response.body", "body": b'{"choices": [', "more_body": True})
        raise ConnectionAbortedError("fake engine drops the connection")


@dataclass
class FakeEngine:
    """Scripted behaviour, reset before each test.

    versions: what /weight_info answers, one per call; the last one repeats.
    info_failures: how many /weight_info calls answer 503 first.
    actions: one per generate call, then "ok" for ever: "ok", "drop", ("status", code, message),
        ("sleep", seconds) then ok unless the client disconnects first, ("reply", dict) verbatim.
    spans: weight-version spans per ok reply, one list per call; then one span of the version
        /weight_info last served, over every token.
    """

    url: str = ""
    versions: list[str] = field(default_factory=lambda: ["default"])
    info_failures: int = 0
    actions: list[Any] = field(default_factory=list)
    spans: list[list[dict]] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    served_version: str = "default"
    disconnects: int = 0  # sleeping requests whose client went away

    def reset(self) -> None:
        self.versions, self.info_failures = ["default"], 0
        self.actions, self.spans, self.calls = [], [], []
        self.served_version, self.disconnects = "default", 0

    def generate_calls(self) -> list[Call]:
        return [c for c in self.calls if c.path == GENERATE]

    def info_calls(self) -> list[Call]:
        return [c for c in self.calls if c.path == WEIGHT_INFO]

    def weight_info(self) -> Response:
        if self.info_failures > 0:
            self.info_failures -= 1
            return JSONResponse({"error": {"message": "engine is paused"}}, status_code=503)
        self.served_version = self.versions.pop(0) if len(self.versions) > 1 else self.versions[0]
        return JSONResponse({"weight_version": self.served_version})

    def reply(self, body: dict) -> dict:
        """A vLLM-shaped reply: output token i is prompt token i + 100 (so a reply shows which
        request it answers), log-prob -(i + 1) / 8, version spans as scripted."""
        n = body["sampling_params"]["max_tokens"]
        tokens = [t + 100 for t in body["token_ids"]][:n]
        spans = self.spans.pop(0) if self.spans else None
        if spans is None:
            spans = [{"version": self.served_version, "start": 0, "end": len(tokens)}]
        return {
            "id": "gen-1",
            "object": "generate",
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "token_ids": tokens,
                    "logprobs": {
                        "content": [
                            {"token_id": t, "logprob": -(i + 1) / 8, "top_logprobs": []}
                            for i, t in enumerate(tokens)
                        ]
                    },
                    "finish_reason": "length",
                    "stop_reason": None,
                    "routed_experts": None,
                    "weight_versions": spans,
                }
            ],
        }

    async def generate(self, body: dict, request: Request) -> Response:
        action = self.actions.pop(0) if self.actions else "ok"
        if action == "drop":
            return DroppedConnection()
        if isinstance(action, tuple) and action[0] == "status":
            _, code, message = action
            return JSONResponse(
                {"error": {"message": message, "type": "BadRequestError", "code": code}},
                status_code=code,
            )
        if isinstance(action, tuple) and action[0] == "sleep":
            deadline = time.monotonic() + action[1]
            while time.monotonic() < deadline:  # stop early once the client has gone
                if await request.is_disconnected():
                    self.disconnects += 1
                    return Response(status_code=499)
                await asyncio.sleep(0.02)
        if isinstance(action, tuple) and action[0] == "reply":
            return JSONResponse(action[1])
        return JSONResponse(self.reply(body))


def make_app(engine: FakeEngine) -> FastAPI:
    app = FastAPI()

    @app.get(WEIGHT_INFO)
    async def weight_info(request: Request):
        engine.calls.append(Call("GET", WEIGHT_INFO, dict(request.headers), None))
        return engine.weight_info()

    @app.post(GENERATE)
    async def generate(request: Request):
        body = await request.json()
        engine.calls.append(Call("POST", GENERATE, dict(request.headers), body))
        return await engine.generate(body, request)

    return app


@pytest.fixture(scope="session")
def fake_engine_server():
    engine = FakeEngine()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(make_app(engine), log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)

    def serve() -> None:
        with contextlib.suppress(SystemExit):
            asyncio.run(server.serve(sockets=[sock]))

    thread = threading.Thread(target=serve, name="fake-vllm-engine", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "fake engine did not start"
    engine.url = f"http://127.0.0.1:{port}"
    yield engine
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture
def engine(fake_engine_server) -> FakeEngine:
    fake_engine_server.reset()
    return fake_engine_server


@pytest.fixture
def closed_port_url() -> str:
    """A loopback URL nothing listens on: every connection is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
