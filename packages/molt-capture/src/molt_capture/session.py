"""One agent episode's token-exact trace: plan a turn, generate, commit, segment.

The engine is always fed the segment's exact token ids. A turn that extends the conversation
appends only the *delta*: the text between the template's render of the history (ending with
the previous reply) and its render of the new request, tokenized on its own. Generated tokens
are stored as sampled and never re-tokenized. When the request is not such an extension
(compaction, rewritten history, a template that drops earlier reasoning, changed tools or
sampling temperature), the segment is sealed and a new one starts from a full render.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import CaptureError
from .render import ChatRenderer, Reply
from .types import Generation, SamplingParams, Segment

Generator = Callable[[list[int], SamplingParams, str], Awaitable[Generation]]


@dataclass
class ChatRequest:
    """A turn as both wires describe it, in chat-template form."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    parse_tools: bool = True  # False for tool_choice "none"


@dataclass
class TurnResult:
    reply: Reply
    finish_reason: str  # "stop", "length" or "tool_calls"
    stop_sequence: str | None
    prompt_tokens: int
    completion_tokens: int


@dataclass
class SessionConfig:
    """Sampling defaults and budget the runner opens a session with."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None  # per-turn default; None: the rest of the context
    max_len: int = 4096  # tokens per segment (prompt + everything generated)
    # Refuse requests whose temperature differs from the run's training temperature.
    strict_temperature: bool = False


@dataclass
class _Plan:
    extend: bool  # append to the open segment; otherwise seal it and start a new one
    context_ids: list[int]  # tokens to append before generating
    prompt_ids: list[int]  # exactly what the engine sees
    prompt_text: str
    params: SamplingParams
    room: int  # tokens left in the context


class Session:
    def __init__(self, session_id: str, config: SessionConfig, row: Any = None):
        self.id = session_id
        self.config = config
        self.row = row  # the dataset row the runner opened the session for
        self.base_url = ""  # set by the server: what the agent's SDK client is given
        self.lock = asyncio.Lock()  # one turn at a time per session
        self.sealed: list[Segment] = []
        self.current: Segment | None = None
        # What the open segment's history is, in template terms, for the extension check.
        self._prompt_text = ""
        self._n_messages = 0
        self._last_reply: Reply | None = None
        self._tools: list[dict] | None = None
        self._last_key: bytes | None = None
        self._last_result: TurnResult | None = None

    def segments(self) -> list[Segment]:
        """Every segment with trained tokens, the open one last."""
        segs = [*self.sealed, *([self.current] if self.current else [])]
        return [s for s in segs if s.num_generated > 0]

    async def turn(
        self,
        request: ChatRequest,
        raw: bytes,
        renderer: ChatRenderer,
        generate: Generator,
        timeout_s: float | None,
    ) -> TurnResult:
        async with self.lock:
            key = hashlib.sha256(raw).digest()
            if key == self._last_key and self._last_result is not None:
                return self._last_result  # a client retry: answer again, record nothing
            plan = self._plan(request, renderer)
            if plan.room <= 0:
                result = self._commit_full(plan)
            else:
                try:
                    gen = await asyncio.wait_for(
                        generate(plan.prompt_ids, plan.params, self.id), timeout_s
                    )
                except asyncio.TimeoutError as e:  # noqa: UP041 (differs on Python 3.10)
                    raise CaptureError(504, f"generator timed out after {timeout_s} s") from e
                except CaptureError:
                    raise
                except Exception as e:
                    raise CaptureError(502, f"generator failed: {type(e).__name__}: {e}") from e
                result = self._commit(plan, request, gen, renderer)
            self._last_key, self._last_result = key, result
            return result

    def _plan(self, req: ChatRequest, renderer: ChatRenderer) -> _Plan:
        """Work out the turn without changing any state, so a failure leaves none behind."""
        cfg = self.config
        temperature = cfg.temperature if req.temperature is None else req.temperature
        top_p = cfg.top_p if req.top_p is None else req.top_p
        if cfg.strict_temperature and temperature != cfg.temperature:
            raise CaptureError(
                400,
                f"temperature {temperature} differs from the training temperature "
                f"{cfg.temperature}; this run refuses it (strict_temperature)",
                "temperature",
            )
        text = renderer.render(req.messages, req.tools, add_generation_prompt=True)
        delta = self._delta(req, renderer, text)
        cur = self.current
        extend = (
            delta is not None
            and cur is not None
            and (cur.temperature, cur.top_p) == (temperature, top_p)
        )
        context_ids = renderer.encode(delta if extend else text)
        prompt_ids = (cur.token_ids if extend else []) + context_ids
        room = cfg.max_len - len(prompt_ids)
        want = req.max_tokens or cfg.max_tokens or room
        routing_start = cur.routing_known if extend and cur is not None else 0
        params = SamplingParams(
            max(0, min(want, room)), temperature, top_p, list(req.stop), routing_start
        )
        return _Plan(extend, context_ids, prompt_ids, text, params, room)

    def _delta(self, req: ChatRequest, renderer: ChatRenderer, text: str) -> str | None:
        """The new request's text beyond the history it extends, or None if it does not."""
        k, reply = self._n_messages, self._last_reply
        if reply is None or len(req.messages) <= k + 1 or req.tools != self._tools:
            return None
        if not reply.matches(req.messages[k]):
            return None  # the client changed our reply: history was rewritten
        history = renderer.render(req.messages[: k + 1], req.tools, add_generation_prompt=False)
        if not history.startswith(self._prompt_text) or not text.startswith(history):
            return None  # an earlier turn renders differently now (compaction, dropped reasoning)
        return text[len(history) :]

    def _open_segment(self, plan: _Plan) -> Segment:
        if not plan.extend:
            if self.current is not None and self.current.num_generated > 0:
                self.sealed.append(self.current)
            self.current = Segment(temperature=plan.params.temperature, top_p=plan.params.top_p)
        assert self.current is not None
        self.current.append_context(plan.context_ids)
        return self.current

    def _commit_full(self, plan: _Plan) -> TurnResult:
        """No room left: answer `length` without generating; the episode was cut short."""
        if plan.extend and self.current is not None:
            self.current.truncated = True
        return TurnResult(Reply(content=""), "length", None, len(plan.prompt_ids), 0)

    def _commit(
        self, plan: _Plan, req: ChatRequest, gen: Generation, renderer: ChatRenderer
    ) -> TurnResult:
        if len(gen.token_ids) > plan.params.max_tokens:
            raise CaptureError(
                502,
                f"generator returned {len(gen.token_ids)} tokens for max_tokens={plan.params.max_tokens}",
            )
        stop_string = gen.stop_reason if isinstance(gen.stop_reason, str) else None
        reply = renderer.parse(
            gen.token_ids, plan.prompt_text, req.tools, stop_string, req.parse_tools
        )
        seg = self._open_segment(plan)
        seg.append_generation(gen, plan.params.max_tokens)
        closing = renderer.missing_closing(gen.token_ids)
        if gen.finish_reason == "length" and plan.params.max_tokens == plan.room:
            seg.truncated = True  # stopped by the context, not by the request
        elif len(seg) + len(closing) <= self.config.max_len:
            # The template's end-of-turn tokens, so the trace reads as the template renders it.
            seg.append_context(closing)
        else:
            seg.truncated = True
        self._prompt_text, self._n_messages = plan.prompt_text, len(req.messages)
        self._last_reply, self._tools = reply, req.tools
        if gen.finish_reason == "length":
            finish = "length"
        else:
            finish = "tool_calls" if reply.tool_calls else "stop"
        return TurnResult(reply, finish, stop_string, len(plan.prompt_ids), len(gen.token_ids))
