"""One agent episode's token-exact trace. A request that extends the last one appends only the new
messages' render; any other seals the segment (docs/concepts/capture.md, the history rule)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import CaptureError, ParamRejected
from .media import ImagePrompt
from .render import ChatRenderer, Reply
from .types import Generation, SamplingParams, Segment, derive_seed

Generator = Callable[[list[int], SamplingParams, str], Awaitable[Generation]]


@dataclass
class ChatRequest:
    """A turn as every wire describes it, in chat-template form."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    parse_tools: bool = True  # False for tool_choice "none"
    # The wire's name for each SamplingParams field, so an engine refusal names the field the
    # client sent (e.g. "stop" -> "stop_sequences").
    param_names: dict[str, str] = field(default_factory=dict)


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
    seed: int | None = None  # turn k samples with derive_seed(seed, k); None: unseeded


@dataclass
class _Plan:
    extend: bool  # append to the open segment; otherwise seal it and start a new one
    context: ImagePrompt  # tokens (and their images) to append before generating
    prompt: ImagePrompt  # exactly what the engine sees
    prompt_text: str  # a render ending as the engine's prompt does (for the reply parser)
    params: SamplingParams
    room: int  # tokens left in the context


class Session:
    def __init__(self, session_id: str, config: SessionConfig, row: Any = None):
        self.id = session_id
        self.config = config
        self.row = row  # the dataset row the runner opened the session for
        self.base_url = ""  # set by the server: what the agent's SDK client is given
        self.lock = asyncio.Lock()  # one turn at a time per session
        self.closed = False  # set by the server's close_session: later turns get 404
        self.sealed: list[Segment] = []
        self.current: Segment | None = None
        # The open segment's conversation: the client's messages, and our replies as `Reply`
        # (a client's echo of a reply may drop reasoning or re-serialise arguments).
        self._history: list[dict | Reply] = []
        self._tools: list[dict] | None = None
        self.responses: dict[str, list[dict]] = {}  # Responses API: id -> its conversation
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
            if self.closed:  # closed while this request was being read or parsed
                raise CaptureError(404, "unknown session (closed, or never opened)")
            key = await asyncio.to_thread(lambda: hashlib.sha256(raw).digest())
            if key == self._last_key and self._last_result is not None:
                return self._last_result  # a client retry: answer again, record nothing
            plan = await asyncio.to_thread(self._plan, request, renderer)
            if plan.room <= 0:  # no room left: `length` without generating, the episode cut
                if plan.extend and self.current is not None:
                    self.current.truncated = True
                result = TurnResult(Reply(""), "length", None, len(plan.prompt.token_ids), 0)
            else:
                gen = await self._generate(plan, request, generate, timeout_s)
                stop = gen.stop_reason if isinstance(gen.stop_reason, str) else None
                parse = (gen.token_ids, plan.prompt_text, request.tools, stop, request.parse_tools)
                reply = await asyncio.to_thread(renderer.parse, *parse)
                result = self._commit(plan, request, gen, reply, renderer)
            self._last_key, self._last_result = key, result
            return result

    async def _generate(
        self, plan: _Plan, req: ChatRequest, generate: Generator, timeout_s: float | None
    ) -> Generation:
        try:
            # Images only when there are some: text-only generators take no such argument.
            extra = {"images": plan.prompt.images} if plan.prompt.images else {}
            call = generate(plan.prompt.token_ids, plan.params, self.id, **extra)
            gen = await asyncio.wait_for(call, timeout_s)
        except asyncio.TimeoutError as e:  # noqa: UP041 (differs on Python 3.10)
            raise CaptureError(504, f"generator timed out after {timeout_s} s") from e
        except ParamRejected as e:
            param = req.param_names.get(e.param, e.param)
            raise CaptureError(400, f"the engine refused {param}: {e.message}", param) from e
        except CaptureError:
            raise
        except Exception as e:
            raise CaptureError(502, f"generator failed: {type(e).__name__}: {e}") from e
        if len(gen.token_ids) > plan.params.max_tokens:
            asked = f"{len(gen.token_ids)} tokens for max_tokens={plan.params.max_tokens}"
            raise CaptureError(502, f"generator returned {asked}")
        return gen

    def _plan(self, req: ChatRequest, renderer: ChatRenderer) -> _Plan:
        """Work out the turn without changing any state, so a failure leaves none behind."""
        cfg = self.config
        temperature = cfg.temperature if req.temperature is None else req.temperature
        top_p = cfg.top_p if req.top_p is None else req.top_p
        if cfg.strict_temperature and temperature != cfg.temperature:
            why = f"differs from the training temperature {cfg.temperature}"
            refused = f"temperature {temperature} {why}; this run refuses it (strict_temperature)"
            raise CaptureError(400, refused, "temperature")
        cur = self.current
        # A segment has one sampling setting, so the trainer recomputes log-probs rightly.
        same_sampling = cur is not None and (cur.temperature, cur.top_p) == (temperature, top_p)
        delta = self._delta(req, renderer) if same_sampling else None
        if cur is not None and delta is not None:
            new = req.messages[len(self._history) :]
            context = renderer.encode_messages(delta[0], new, "messages")
            shifted = [image.shifted(len(cur)) for image in context.images]
            prompt = ImagePrompt(cur.token_ids + context.token_ids, cur.images + shifted)
            prompt_text, routing_start = delta[1], cur.routing_known
        else:
            prompt_text = renderer.render(req.messages, req.tools, add_generation_prompt=True)
            context = prompt = renderer.encode_messages(prompt_text, req.messages, "messages")
            routing_start = 0
        room = cfg.max_len - len(prompt.token_ids)
        max_tokens = max(0, min(req.max_tokens or cfg.max_tokens or room, room))
        turn = sum(len(s.turns) for s in [*self.sealed, *([cur] if cur else [])])
        seed = None if cfg.seed is None else derive_seed(cfg.seed, turn)
        params = SamplingParams(max_tokens, temperature, top_p, list(req.stop), routing_start, seed)
        return _Plan(delta is not None, context, prompt, prompt_text, params, room)

    def _delta(self, req: ChatRequest, renderer: ChatRenderer) -> tuple[str, str] | None:
        """The new messages' text and the render it ends if `req` extends the open segment."""
        history, k = self._history, len(self._history)
        if not history or len(req.messages) <= k or req.tools != self._tools:
            return None
        for old, msg in zip(history, req.messages, strict=False):
            if not (old.matches(msg) if isinstance(old, Reply) else old == msg):
                return None  # history was rewritten (compaction, an edited message)
        return renderer.render_delta(history[-1].as_message(), req.messages[k:], req.tools)

    def _commit(
        self, plan: _Plan, req: ChatRequest, gen: Generation, reply: Reply, renderer: ChatRenderer
    ) -> TurnResult:
        if not plan.extend:
            if self.current is not None and self.current.num_generated > 0:
                self.sealed.append(self.current)
            self.current = Segment(temperature=plan.params.temperature, top_p=plan.params.top_p)
        seg = self.current
        seg.append_context(plan.context.token_ids, plan.context.images)
        seg.append_generation(gen, plan.params.max_tokens)
        closing = renderer.missing_closing(gen.token_ids)
        # Stopped by the context (not by the request), or no room left for the closing tokens.
        by_context = gen.finish_reason == "length" and plan.params.max_tokens == plan.room
        if by_context or len(seg) + len(closing) > self.config.max_len:
            seg.truncated = True
        else:
            # The template's end-of-turn tokens, so the trace reads as the template renders it.
            seg.append_context(closing)
        earlier = self._history if plan.extend else []
        self._history = [*earlier, *req.messages[len(earlier) :], reply]
        self._tools = req.tools
        finish = "tool_calls" if reply.tool_calls else "stop"
        finish = "length" if gen.finish_reason == "length" else finish
        stop = gen.stop_reason if isinstance(gen.stop_reason, str) else None
        return TurnResult(reply, finish, stop, len(plan.prompt.token_ids), len(gen.token_ids))
