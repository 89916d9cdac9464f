"""The capture server: FastAPI routes for every wire, the session registry, and an in-process
uvicorn on a background thread with an ephemeral port (one per agent-runner process).

Every session lives under `/s/{session_id}`; that prefix is the SDK `base_url`. The OpenAI SDK
appends `/chat/completions` or `/responses` and the Anthropic SDK `/v1/messages`, so all are
served there (and under `/v1/...` for clients given the conventional `.../v1` base).
Every error, unknown routes and methods included, is in the wire's own error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from . import anthropic_wire, openai_wire, responses_wire
from .errors import MAX_REQUEST_BYTES, CaptureError
from .media import ImageEncoder
from .render import ChatRenderer
from .session import Generator, Session, SessionConfig
from .types import Segment

log = logging.getLogger(__name__)

WORKER_THREADS = 32


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class CaptureServer:
    """Serves sessions for one agent-runner process.

    `generator` is the token-level engine call (token ids, sampling params, session id) ->
    `Generation`. `parser` names the reply markup family (see `render.RESPONSE_TEMPLATES`).
    `api_key`, when set, must be sent as `Authorization: Bearer ...` or `x-api-key`; it is
    required when binding beyond loopback. A request body over `max_request_bytes` gets 413.
    """

    def __init__(
        self,
        tokenizer,
        generator: Generator,
        *,
        parser: str = "qwen3",
        chat_template_kwargs: dict | None = None,
        model_name: str = "molt-policy",
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        generator_timeout_s: float | None = 600.0,
        strict_temperature: bool = False,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        image_encoder: ImageEncoder | None = None,
    ):
        if not is_loopback(host) and not api_key:
            raise ValueError(f"binding {host} (beyond loopback) requires an api_key")
        self.renderer = ChatRenderer(tokenizer, parser, chat_template_kwargs)
        # A multimodal model's processor: the wires then take image parts (else a clear 400),
        # rendered with the processor into the trace and recorded on the segment.
        self.renderer.images = image_encoder
        self.generator = generator
        self.model_name = model_name
        self.host, self.port = host, port
        self.api_key = api_key
        self.generator_timeout_s = generator_timeout_s
        self.strict_temperature = strict_temperature
        self.max_request_bytes = max_request_bytes
        self.sessions: dict[str, Session] = {}
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- the runner's session API -------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def open_session(
        self,
        row: Any = None,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int | None = None,
        max_len: int = 4096,
    ) -> Session:
        """Register a session; `session.base_url` is what the agent's SDK client is given
        (open sessions after `start()`, which fixes the port)."""
        sid = secrets.token_urlsafe(24)  # 192 bits: the id is the capability
        cfg = SessionConfig(temperature, top_p, max_tokens, max_len, self.strict_temperature)
        self.sessions[sid] = session = Session(sid, cfg, row)
        session.base_url = self.base_url(sid)
        return session

    def base_url(self, session_id: str) -> str:
        return f"{self.url}/s/{session_id}"

    def close_session(self, session_id: str, timeout_s: float | None = None) -> list[Segment]:
        """Forget the session (later requests get 404) and hand back its token-exact segments,
        in order. Called from another thread while serving, it first waits for a turn still in
        flight to commit, so no generated turn is lost or read half-written."""
        session = self.sessions.pop(session_id)
        session.closed = True
        loop = self._loop
        if loop is None or not loop.is_running() or threading.current_thread() is self._thread:
            return session.segments()

        async def settled() -> list[Segment]:
            async with session.lock:
                return session.segments()

        return asyncio.run_coroutine_threadsafe(settled(), loop).result(timeout_s)

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> CaptureServer:
        """Serve on a background thread with its own event loop; returns once listening."""
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="molt-capture", daemon=True)
        self._thread.start()
        for _ in range(int(timeout_s / 0.01)):
            if self._server.started or not self._thread.is_alive():
                break
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError(f"capture server did not start on {self.host}:{self.port}")
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def _serve(self) -> None:
        # Our own loop (rather than uvicorn's run) so close_session can schedule onto it.
        self._loop = asyncio.new_event_loop()
        # Parsing, rendering and tokenizing run on this pool (asyncio.to_thread): wide, so a
        # few huge requests cannot take every worker from the small ones (the default pool
        # has cores + 4).
        workers = ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="molt-capture-work")
        self._loop.set_default_executor(workers)
        with contextlib.suppress(SystemExit):  # uvicorn exits if it cannot bind; start() says so
            self._loop.run_until_complete(self._server.serve())
        self._loop.run_until_complete(self._loop.shutdown_default_executor())
        self._loop.close()

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            assert self._thread is not None
            self._thread.join(timeout=10)
            self._server = None

    def __enter__(self) -> CaptureServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- HTTP ----------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="molt-capture", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {"status": "ok", "sessions": len(self.sessions)}

        def route(turn: Callable, error_body: Callable) -> Callable:
            async def endpoint(session_id: str, request: Request):
                return await self._handle(session_id, request, turn, error_body)

            return endpoint

        chat = route(self._openai_turn, openai_wire.error_body)
        responses = route(self._responses_turn, openai_wire.error_body)
        models = route(self._models, openai_wire.error_body)
        for prefix in ("/s/{session_id}", "/s/{session_id}/v1"):
            app.add_api_route(prefix + "/chat/completions", chat, methods=["POST"])
            app.add_api_route(prefix + "/responses", responses, methods=["POST"])
            app.add_api_route(prefix + "/models", models, methods=["GET"])
        messages = route(self._anthropic_turn, anthropic_wire.error_body)
        count = route(self._count_tokens, anthropic_wire.error_body)
        app.add_api_route("/s/{session_id}/v1/messages", messages, methods=["POST"])
        app.add_api_route("/s/{session_id}/v1/messages/count_tokens", count, methods=["POST"])

        @app.exception_handler(HTTPException)
        async def routing_error(request: Request, exc: HTTPException) -> JSONResponse:
            # Unknown routes and methods: the Anthropic SDK always sends anthropic-version.
            anthropic = "anthropic-version" in request.headers or "/messages" in request.url.path
            error_body = anthropic_wire.error_body if anthropic else openai_wire.error_body
            what = "method not allowed" if exc.status_code == 405 else "no such route"
            err = CaptureError(exc.status_code, f"{what}: {request.method} {request.url.path}")
            return JSONResponse(error_body(err), status_code=exc.status_code)

        return app

    async def _handle(
        self, session_id: str, request: Request, turn: Callable, error_body: Callable
    ):
        """Common to every route: auth, session lookup, body, and errors in the wire's shape."""
        try:
            self._check_auth(request)
            session = self.sessions.get(session_id)
            if session is None:
                raise CaptureError(404, "unknown session (closed, or never opened)")
            return await turn(session, await self._body(request))
        except CaptureError as e:
            return JSONResponse(error_body(e), status_code=e.status)
        except Exception as e:  # a bug, not the client's fault: say so without a traceback
            log.exception("capture server error")
            err = CaptureError(500, f"internal error: {type(e).__name__}")
            return JSONResponse(error_body(err), status_code=500)

    async def _body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to exceed the limit."""
        limit = self.max_request_bytes
        too_large = CaptureError(413, f"request body exceeds {limit} bytes (max_request_bytes)")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_auth(self, request: Request) -> None:
        if not self.api_key:
            return
        given = request.headers.get("x-api-key") or ""
        bearer = request.headers.get("authorization") or ""
        if bearer.lower().startswith("bearer "):
            given = given or bearer[7:]
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise CaptureError(401, "missing or wrong API key")

    async def _run(self, session: Session, chat, raw: bytes):
        return await session.turn(
            chat, raw, self.renderer, self.generator, self.generator_timeout_s
        )

    async def _openai_turn(self, session: Session, raw: bytes):
        # Parsing (like rendering) runs on a worker thread: a large body must not hold the loop.
        images = self.renderer.images is not None
        req, chat = await asyncio.to_thread(openai_wire.parse_request, raw, images)
        result = await self._run(session, chat, raw)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(openai_wire.stream(result, self.model_name, usage))
        return JSONResponse(openai_wire.completion(result, self.model_name))

    async def _responses_turn(self, session: Session, raw: bytes):
        images = self.renderer.images is not None
        parsed = await asyncio.to_thread(
            responses_wire.parse_request, raw, session.responses, images
        )
        result = await self._run(session, parsed.chat, raw)
        resp = responses_wire.response(parsed, result, self.model_name)
        # What a follow-up naming this response continues from (instructions are not carried).
        session.responses[resp["id"]] = [*parsed.conversation, result.reply.as_message()]
        if parsed.request.stream:
            return _sse(responses_wire.stream(resp))
        return JSONResponse(resp)

    async def _anthropic_turn(self, session: Session, raw: bytes):
        images = self.renderer.images is not None
        req, chat = await asyncio.to_thread(anthropic_wire.parse_request, raw, images)
        result = await self._run(session, chat, raw)
        if req.stream:
            return _sse(anthropic_wire.stream(result, self.model_name))
        return JSONResponse(anthropic_wire.message(result, self.model_name))

    async def _count_tokens(self, session: Session, raw: bytes):
        def count() -> int:
            chat = anthropic_wire.parse_count_request(raw)
            text = self.renderer.render(chat.messages, chat.tools, add_generation_prompt=True)
            return len(self.renderer.encode(text))

        return JSONResponse({"input_tokens": await asyncio.to_thread(count)})

    async def _models(self, session: Session, raw: bytes):
        return JSONResponse(openai_wire.models(self.model_name))


def _sse(events: Iterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"cache-control": "no-cache"}
    )
