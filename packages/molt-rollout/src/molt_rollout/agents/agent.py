"""The agent contract: an `Env` (the runner owns the LLM loop and calls `env.step`) or a
`ChatAgent` (it owns its loop through a stock SDK pointed at `ctx.base_url`), each answering
with a `Result`; a module exports `AgentRunner`. See docs/concepts/agents.md."""

from __future__ import annotations

import asyncio
import copy
import math
import time
import traceback
import weakref
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from molt_capture import Generator, Reply
from molt_capture.media import ImageEncoder
from molt_capture.types import Rollout
from molt_rollout.config import RolloutConfig

T = TypeVar("T")


@dataclass
class Result:
    """What an Env step or a ChatAgent run returns. `score`: the task metric when it differs
    from the reward; numeric `info` values reach the logs. Env form only: `observation` (text
    appended verbatim, or chat messages rendered with the chat template) is shown to the model
    unless the episode ends; `max_tokens`, `temperature`, `stop` set the next turn's sampling."""

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
    """What a ChatAgent gets: the prompt, its session's URLs for OpenAI SDKs (`base_url`) and
    Anthropic SDKs (`anthropic_base_url`), and the sampling defaults."""

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
        """A stock `openai.AsyncOpenAI` for this session, on the event loop's shared connections."""
        import openai

        return openai.AsyncOpenAI(**self._sdk_args(openai, self.base_url), **kwargs)

    def anthropic_client(self, **kwargs: Any) -> Any:
        """A stock `anthropic.AsyncAnthropic` for this session, as `openai_client`."""
        import anthropic

        args = self._sdk_args(anthropic, self.anthropic_base_url)
        return anthropic.AsyncAnthropic(**args, **kwargs)

    def _sdk_args(self, sdk: Any, base_url: str) -> dict[str, Any]:
        """The session's URL and key, on the running event loop's shared HTTP client for `sdk`."""
        clients = _HTTP_CLIENTS.setdefault(asyncio.get_running_loop(), {})
        if sdk.__name__ not in clients:
            client = clients[sdk.__name__] = sdk.DefaultAsyncHttpxClient()
            client.aclose = _keep_open  # every rollout on the loop uses it: it goes with the loop
        return {"base_url": base_url, "api_key": self.api_key, "http_client": clients[sdk.__name__]}

    def anthropic_args(self) -> dict[str, Any]:
        """`system`, `messages`, `tools` and `max_tokens` for `client.messages.create(...)`."""
        messages = list(self.messages)
        args: dict[str, Any] = {"max_tokens": self.max_tokens or self.max_len}
        if messages and messages[0]["role"] == "system":
            args["system"] = messages.pop(0)["content"]
        args["messages"] = messages
        if self.tools:
            args["tools"] = [_anthropic_tool(t["function"]) for t in self.tools]
        return args


# An SDK client built without an `http_client` loads the system's CA certificates, per rollout
# in the usual agent: one client per event loop instead (docs/performance.md).
_HTTP_CLIENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def _keep_open() -> None:
    pass


def _anthropic_tool(fn: dict[str, Any]) -> dict[str, Any]:
    schema = fn.get("parameters") or {"type": "object", "properties": {}}
    return {**_given(fn, "name", "description"), "input_schema": schema}


def _given(fn: dict[str, Any], *keys: str) -> dict[str, Any]:
    """Those of `keys` that `fn` gives a value (not None), in that order."""
    return {key: fn[key] for key in keys if fn.get(key) is not None}


@dataclass
class Dropped:
    """A rollout that produced nothing trainable, counted as `rollout/dropped/<reason>`:
    agent_error, engine_error, deadline, bad_result, bad_row, prompt_too_long, empty (no model
    call), session_busy (a model call left running) or an agent's own."""

    reason: str
    detail: str
    rollout_id: str
    group_id: str
    elapsed_s: float


class RolloutDropped(Exception):
    """Ends a rollout as `Dropped` (never escapes `Runner.run`); an agent may raise it too."""

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


class Runner:
    """What EnvRunner and ChatRunner share."""

    def __init__(
        self,
        generator: Generator,
        tokenizer,
        config: RolloutConfig | None = None,
        apply_chat_template: bool = True,
        image_encoder: ImageEncoder | None = None,
    ):
        """`apply_chat_template` False: a base model's string prompts as written (Env form).
        `image_encoder`: a multimodal model's processor; None: text only, images refused."""
        self.generator, self.tokenizer, self.image_encoder = generator, tokenizer, image_encoder
        self.config, self.apply_chat_template = config or RolloutConfig(), apply_chat_template

    def with_sampling(self, config: RolloutConfig) -> Runner:
        """This runner with other sampling and limits (the eval's), sharing everything else."""
        sibling = copy.copy(self)
        sibling.config = config
        return sibling

    def close(self) -> None:
        """Release what the runner holds (the chat runner's capture server)."""

    async def run(self, row: dict[str, Any], rollout_id: str, group_id: str) -> Rollout | Dropped:
        """One rollout; never raises for an agent's or engine's failure, returns `Dropped`."""
        t0 = time.monotonic()
        try:
            return await self._rollout(row, rollout_id, group_id, t0)
        except RolloutDropped as d:
            return Dropped(d.reason, d.detail, rollout_id, group_id, time.monotonic() - t0)

    async def _rollout(self, row: dict, rollout_id: str, group_id: str, t0: float):
        raise NotImplementedError


def row_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's `prompt`: a list of chat messages, or a string taken as one user turn."""
    if "prompt" not in row:
        raise RolloutDropped("bad_row", f"row has no 'prompt' (keys: {sorted(row)})")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def canonical_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tool schemas in the key order the capture server's wires produce (chat templates keep
    key order), so both agent forms render byte-identical prompts."""
    fns = [_given(tool["function"], "name", "description", "parameters") for tool in tools or []]
    return [{"type": "function", "function": fn} for fn in fns] or None


def check_result(result: Any) -> Result:
    if not isinstance(result, Result):
        raise RolloutDropped("bad_result", f"expected a Result, got {type(result).__name__}")
    if not _is_number(result.reward) or not math.isfinite(result.reward):
        raise RolloutDropped("bad_result", f"reward {result.reward!r} is not a finite number")
    if result.score is not None and not _is_number(result.score):
        raise RolloutDropped("bad_result", f"score {result.score!r} is not a number or None")
    return result


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def numeric_info(info: dict[str, Any]) -> dict[str, float]:
    """The info entries a metrics logger can plot (bools as 0/1)."""
    return {k: float(v) for k, v in info.items() if isinstance(v, int | float)}


def describe(error: BaseException) -> str:
    """`Type: message (file:line in function)` of where it was raised, for Dropped.detail."""
    frames, where = traceback.extract_tb(error.__traceback__, limit=-1), ""
    if frames:
        where = f" ({Path(frames[0].filename).name}:{frames[0].lineno} in {frames[0].name})"
    return f"{type(error).__name__}: {error}{where}"


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
    # Its exception retrieved when it ends, so asyncio does not warn about it.
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    raise RolloutDropped("deadline", f"rollout still running after {deadline_s} s")
