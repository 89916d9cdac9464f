"""The capture server: every wire's routes under `/s/{session_id}` (the SDKs' `base_url`) on an
in-process uvicorn, on a background thread (docs/concepts/capture.md)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass
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
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(eq=False, repr=False)  # identity semantics, as a plain class
class CaptureServer:
    """Serves sessions for one agent-runner process; `generator`: the engine call."""

    tokenizer: Any
    generator: Generator
    _: KW_ONLY
    parser: str = "qwen3"  # the reply markup family (render.RESPONSE_TEMPLATES)
    chat_template_kwargs: dict | None = None
    model_name: str = "molt-policy"
    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None  # a Bearer token or `x-api-key`; required beyond loopback
    generator_timeout_s: float | None = 600.0
    strict_temperature: bool = False
    max_request_bytes: int = MAX_REQUEST_BYTES
    # A multimodal model's processor: the wires then take image parts (else a clear 400),
    # rendered with the processor into the trace and recorded on the segment.
    image_encoder: ImageEncoder | None = None

    def __post_init__(self) -> None:
        if not is_loopback(self.host) and not self.api_key:
            raise ValueError(f"binding {self.host} (beyond loopback) requires an api_key")
        self.renderer = ChatRenderer(self.tokenizer, self.parser, self.chat_template_kwargs)
        self.renderer.images = self.image_encoder
        self.sessions: dict[str, Session] = {}
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- the runner's session API -------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def open_session(self, row: Any = None, **config: Any) -> Session:
        """A new session with `SessionConfig(**config)`; open it after `start()` (which fixes the
        port in `session.base_url`)."""
        sid = secrets.token_urlsafe(24)  # 192 bits: the id is the capability
        cfg = SessionConfig(**config, strict_temperature=self.strict_temperature)
        self.sessions[sid] = session = Session(sid, cfg, row)
        session.base_url = self.base_url(sid)
        return session

    def base_url(self, session_id: str) -> str:
        return f"{self.url}/s/{session_id}"

    def close_session(self, session_id: str, timeout_s: float | None = None) -> list[Segment]:
        """Forget the session (later requests get 404) and hand back its segments, once a turn
        still in flight has committed (no generated turn lost or read half-written)."""
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
        config = (self.app, self.host, self.port)
        options = {"log_level": "warning", "access_log": False, "lifespan": "off"}
        self._server = uvicorn.Server(uvicorn.Config(*config, **options))
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
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
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

        def route(path: str, method: str, wire, answer: Callable) -> None:
            async def endpoint(session_id: str, request: Request):
                return await self._handle(session_id, request, wire, answer)

            app.add_api_route("/s/{session_id}" + path, endpoint, methods=[method])

        for prefix in ("", "/v1"):
            route(prefix + "/chat/completions", "POST", openai_wire, self._turn)
            route(prefix + "/responses", "POST", responses_wire, self._turn)
            route(prefix + "/models", "GET", openai_wire, self._models)
        route("/v1/messages", "POST", anthropic_wire, self._turn)
        route("/v1/messages/count_tokens", "POST", anthropic_wire, self._count_tokens)

        @app.exception_handler(HTTPException)
        async def routing_error(request: Request, exc: HTTPException) -> JSONResponse:
            # Unknown routes and methods: the Anthropic SDK always sends anthropic-version.
            anthropic = "anthropic-version" in request.headers or "/messages" in request.url.path
            wire = anthropic_wire if anthropic else openai_wire
            what = "method not allowed" if exc.status_code == 405 else "no such route"
            err = CaptureError(exc.status_code, f"{what}: {request.method} {request.url.path}")
            return JSONResponse(wire.error_body(err), status_code=exc.status_code)

        return app

    async def _handle(self, session_id: str, request: Request, wire, answer: Callable):
        try:
            self._check_auth(request)
            session = self.sessions.get(session_id)
            if session is None:
                raise CaptureError(404, "unknown session (closed, or never opened)")
            return await answer(wire, session, await self._body(request))
        except CaptureError as e:
            return JSONResponse(wire.error_body(e), status_code=e.status)
        except Exception as e:  # a bug, not the client's fault: say so without a traceback
            log.exception("capture server error")
            err = CaptureError(500, f"internal error: {type(e).__name__}")
            return JSONResponse(wire.error_body(err), status_code=500)

    async def _body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to exceed the limit."""
        limit = self.max_request_bytes
        too_large = CaptureError(413, f"request body exceeds {limit} bytes (max_request_bytes)")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        return bytes(body)

    def _check_auth(self, request: Request) -> None:
        if not self.api_key:
            return
        bearer = request.headers.get("authorization") or ""
        bearer = bearer[7:] if bearer.lower().startswith("bearer ") else ""
        given = request.headers.get("x-api-key") or bearer
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise CaptureError(401, "missing or wrong API key")

    async def _turn(self, wire, session: Session, raw: bytes):
        """One generated turn on any wire, parsed (like rendered) off the loop."""
        images = self.renderer.images is not None
        responses = (session.responses,) if wire is responses_wire else ()
        req, chat = await asyncio.to_thread(wire.parse_request, raw, images, *responses)
        timeout_s = self.generator_timeout_s
        result = await session.turn(chat, raw, self.renderer, self.generator, timeout_s)
        body = wire.reply(req, chat, result, self.model_name)
        if responses:
            session.responses[body["id"]] = responses_wire.conversation(req, chat, result)
        if not req.stream:
            return JSONResponse(body)
        events = wire.stream(req, body)
        headers = {"cache-control": "no-cache"}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    async def _count_tokens(self, wire, session: Session, raw: bytes):
        def count() -> int:
            chat = anthropic_wire.parse_count_request(raw)
            text = self.renderer.render(chat.messages, chat.tools, add_generation_prompt=True)
            return len(self.renderer.encode(text))

        return JSONResponse({"input_tokens": await asyncio.to_thread(count)})

    async def _models(self, wire, session: Session, raw: bytes):
        return JSONResponse(openai_wire.models(self.model_name))
