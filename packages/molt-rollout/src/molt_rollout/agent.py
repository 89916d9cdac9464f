"""The agent contract: what a researcher's file provides and what the runners give it.

Two forms. An `Env` lets the framework own the LLM loop: the runner generates, calls
`env.step(state)`, appends the observation and repeats. A `ChatAgent` owns its loop through a
stock OpenAI or Anthropic SDK pointed at `ctx.base_url` (a capture-server session). Either way the
agent answers with a `Result`. A user module exports one name, `AgentRunner`: a subclass of
`EnvRunner` (with `env_class`) or of `ChatRunner` (with `agent_class`). `load_agent`
(molt_rollout.loader) imports and checks such a module. See docs/agents.md.
"""

from __future__ import annotations

import asyncio
import functools
import math
import weakref
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from molt_capture import Reply

T = TypeVar("T")


@dataclass
class Result:
    """What an Env step or a ChatAgent run returns.

    `reward` is the training signal, `score` the task metric when it differs (e.g. pass/fail
    under a shaped reward). `info` values that are numbers reach the logs; others are dropped.
    Env form only: `observation` (text appended verbatim, or chat messages rendered with the
    model's chat template) is shown to the model when `terminated` and `truncated` are both
    False; `max_tokens`, `temperature` and `stop` override sampling for the next turn only.
    """

    reward: float
    score: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    observation: str | list[dict[str, Any]] = ""
    terminated: bool = True
    truncated: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    stop: list[str] | None = None


@dataclass
class EnvState:
    """What an Env sees. The runner updates it before every `step`; `data` is the Env's own."""

    row: dict[str, Any]  # the prompt row as the dataset gave it
    messages: list[dict[str, Any]]  # prompt, then each reply and each observation message
    tools: list[dict[str, Any]] | None
    label: Any
    turn: int = 0  # index of the turn just generated (0 in reset)
    text: str = ""  # the last reply, decoded (special tokens skipped)
    token_ids: list[int] = field(default_factory=list)  # the last reply as sampled
    finish_reason: str = ""  # "stop" or "length" (cut by max_tokens or the budget)
    reply: Reply | None = None  # parsed: content, reasoning, tool_calls (name, arguments)
    transcript: str = ""  # everything after the prompt, decoded: replies and observations
    data: dict[str, Any] = field(default_factory=dict)
    rollout_id: str = ""  # this rollout's id (also on the trained Rollout), e.g. to tag logs
    group_id: str = ""  # its prompt group's id: the n rollouts of one prompt share it


@dataclass
class ChatContext:
    """What a ChatAgent gets: the prompt, where to send requests, and the sampling defaults.

    `base_url` is the capture session for OpenAI SDKs (`OpenAI(base_url=ctx.base_url)`), and
    `anthropic_base_url` for Anthropic SDKs (`Anthropic(base_url=ctx.anthropic_base_url)`); the
    server serves both wires under one session URL today, but use the field for your SDK.
    `openai_client()` and `anthropic_client()` build those stock clients cheaply.
    """

    messages: list[dict[str, Any]]  # OpenAI / chat-template form, system turn included
    tools: list[dict[str, Any]] | None  # OpenAI function tools
    label: Any
    row: dict[str, Any]
    base_url: str
    anthropic_base_url: str
    model: str
    api_key: str  # a placeholder: the session id in the URL is the capability
    temperature: float
    top_p: float
    max_tokens: int | None  # per-turn default; None: the rest of the context
    max_len: int  # tokens per segment (prompt + everything generated)
    rollout_id: str = ""
    group_id: str = ""
    deadline_s: float | None = None  # the runner drops the rollout after this long

    def openai_client(self, **kwargs: Any) -> Any:
        """A stock `openai.AsyncOpenAI` pointed at this session, on the event loop's shared
        connections (`shared_http_client`). `kwargs` go to its constructor (`max_retries`, ...)."""
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key,
                                  http_client=shared_http_client(openai), **kwargs)  # fmt: skip

    def anthropic_client(self, **kwargs: Any) -> Any:
        """A stock `anthropic.AsyncAnthropic` pointed at this session, as `openai_client`."""
        import anthropic

        return anthropic.AsyncAnthropic(
            base_url=self.anthropic_base_url, api_key=self.api_key,
            http_client=shared_http_client(anthropic), **kwargs,
        )  # fmt: skip

    def anthropic_args(self) -> dict[str, Any]:
        """`system`, `messages`, `tools` and `max_tokens` for `client.messages.create(...)`:
        the leading system turn moved to `system`, tools in Anthropic's `input_schema` form."""
        messages = list(self.messages)
        args: dict[str, Any] = {"max_tokens": self.max_tokens or self.max_len}
        if messages and messages[0]["role"] == "system":
            args["system"] = messages.pop(0)["content"]
        args["messages"] = messages
        if self.tools:
            args["tools"] = [_anthropic_tool(t["function"]) for t in self.tools]
        return args


# An SDK client built without an `http_client` builds its own and loads the system's CA
# certificates: about 20 ms of CPU, per rollout in the usual agent, against 0.05 ms with one
# shared per event loop (docs/agents.md, "One connection pool per runner").
_HTTP_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Any]] = (
    weakref.WeakKeyDictionary()
)


def shared_http_client(sdk: Any) -> Any:
    """The running event loop's HTTP client for `sdk` (the `openai` or `anthropic` module).
    Closing an SDK client built on it (`async with`) leaves it open for the loop's other
    rollouts."""
    clients = _HTTP_CLIENTS.setdefault(asyncio.get_running_loop(), {})
    if sdk.__name__ not in clients:
        clients[sdk.__name__] = _unclosable(sdk.DefaultAsyncHttpxClient)()
    return clients[sdk.__name__]


@functools.cache
def _unclosable(http_client_class: type) -> type:
    class Shared(http_client_class):
        async def aclose(self) -> None:
            pass  # every rollout on the loop uses it: it goes with the loop

    return Shared


def _anthropic_tool(fn: dict[str, Any]) -> dict[str, Any]:
    tool = {"name": fn["name"]}
    if fn.get("description") is not None:
        tool["description"] = fn["description"]
    tool["input_schema"] = fn.get("parameters") or {"type": "object", "properties": {}}
    return tool


@dataclass
class Dropped:
    """A rollout that produced nothing trainable; the pool counts `rollout/dropped/<reason>`.

    Reasons: `agent_error` (the Env or ChatAgent raised), `engine_error` (the engine call
    failed: in the ChatAgent form, the agent raised after one did), `deadline`, `bad_result`
    (not a Result, or a non-finite reward), `bad_row` (no prompt, or the chat template rejects
    it), `prompt_too_long`, `empty` (a ChatAgent that never called the model), `session_busy`
    (a ChatAgent returned with a model call still running). `detail` says what happened, for
    the log.
    """

    reason: str
    detail: str
    rollout_id: str
    group_id: str
    elapsed_s: float


class RolloutDropped(Exception):
    """Ends a rollout as `Dropped`; never escapes a runner's `run()`. Runners raise it, and an
    Env or ChatAgent may too, to drop a rollout on purpose with its own reason."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class Env:
    """Subclass and implement `step`; one instance per rollout, so attributes are per episode."""

    async def reset(self, state: EnvState) -> None:
        """Called once before the first generation (set up tools, sandboxes, state.data)."""

    async def step(self, state: EnvState) -> Result:
        raise NotImplementedError


class ChatAgent:
    """Subclass and implement `run`; one instance per rollout."""

    async def run(self, ctx: ChatContext) -> Result:
        raise NotImplementedError


# ---- helpers both runners share ----------------------------------------------------------


def row_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's `prompt`: a list of chat messages, or a string taken as one user turn."""
    if "prompt" not in row:
        raise RolloutDropped("bad_row", f"row has no 'prompt' (keys: {sorted(row)})")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def canonical_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tool schemas in the key order the capture server's wires produce (`tojson` in chat
    templates keeps key order), so both agent forms render byte-identical prompts."""
    out = []
    for tool in tools or []:
        fn = tool["function"]
        canon = {"name": fn["name"]}
        if fn.get("description") is not None:
            canon["description"] = fn["description"]
        if fn.get("parameters") is not None:
            canon["parameters"] = fn["parameters"]
        out.append({"type": "function", "function": canon})
    return out or None


def check_result(result: Any) -> Result:
    if not isinstance(result, Result):
        raise RolloutDropped("bad_result", f"expected a Result, got {type(result).__name__}")
    if isinstance(result.reward, bool) or not isinstance(result.reward, int | float):
        raise RolloutDropped("bad_result", f"reward {result.reward!r} is not a number")
    if not math.isfinite(result.reward):
        raise RolloutDropped("bad_result", f"reward {result.reward} is not finite")
    score = result.score
    if score is not None and (isinstance(score, bool) or not isinstance(score, int | float)):
        raise RolloutDropped("bad_result", f"score {score!r} is not a number or None")
    return result


def numeric_info(info: dict[str, Any]) -> dict[str, float]:
    """The info entries a metrics logger can plot (bools as 0/1)."""
    return {k: float(v) for k, v in info.items() if isinstance(v, int | float)}


def describe(error: BaseException) -> str:
    """`Type: message (file:line in function)` of where it was raised, for Dropped.detail."""
    where = ""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        code = tb.tb_frame.f_code
        where = f" ({Path(code.co_filename).name}:{tb.tb_lineno} in {code.co_name})"
    return f"{type(error).__name__}: {error}{where}"


def _consume(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not warn about it


async def within_deadline(coro: Awaitable[T], deadline_s: float | None) -> T:
    """Await `coro`, returning by the deadline even if it ignores cancellation (a hung agent
    must never stall the pool): on overrun it is cancelled and left to finish on its own."""
    task = asyncio.ensure_future(coro)
    try:
        done, _ = await asyncio.wait({task}, timeout=deadline_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task in done:
        return task.result()
    task.cancel()
    task.add_done_callback(_consume)
    raise RolloutDropped("deadline", f"rollout still running after {deadline_s} s")
