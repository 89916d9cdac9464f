"""The agent contract: what a researcher's file provides and what the runners give it.

Two forms. An `Env` lets the framework own the LLM loop: the runner generates, calls
`env.step(state)`, appends the observation and repeats. A `ChatAgent` owns its loop through a
stock OpenAI or Anthropic SDK pointed at `ctx.base_url` (a capture-server session). Either way the
agent answers with a `Result`. A user module exports one name, `AgentRunner`: a subclass of
`EnvRunner` (with `env_class`) or of `ChatRunner` (with `agent_class`). `load_agent` imports and
checks such a module. See docs/agents.md.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from molt_capture import Reply
from molt_capture.server import MAX_REQUEST_BYTES

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


@dataclass
class ChatContext:
    """What a ChatAgent gets: the prompt, where to send requests, and the sampling defaults.

    `base_url` is the capture session for OpenAI SDKs (`OpenAI(base_url=ctx.base_url)`), and
    `anthropic_base_url` for Anthropic SDKs (`Anthropic(base_url=ctx.anthropic_base_url)`); the
    server serves both wires under one session URL today, but use the field for your SDK.
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


def _anthropic_tool(fn: dict[str, Any]) -> dict[str, Any]:
    tool = {"name": fn["name"]}
    if fn.get("description") is not None:
        tool["description"] = fn["description"]
    tool["input_schema"] = fn.get("parameters") or {"type": "object", "properties": {}}
    return tool


@dataclass
class RunnerConfig:
    """Sampling and limits for both runner forms (the Env-only fields say so)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None  # per turn; None: whatever the budgets leave
    max_len: int = 4096  # tokens in the whole trace: prompt, replies, observations
    max_response_tokens: int | None = None  # Env: generated tokens per rollout, all turns
    max_turns: int = 8  # Env: generations per rollout
    deadline_s: float | None = 600.0  # wall clock per rollout; then it is dropped
    apply_chat_template: bool = True  # Env: False encodes a string prompt verbatim
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    parser: str = "qwen3"  # reply markup family (molt_capture.PARSERS)
    model_name: str = "molt-policy"  # ChatAgent: what the server calls the model
    generator_timeout_s: float | None = 600.0  # ChatAgent: one engine call
    max_request_bytes: int = MAX_REQUEST_BYTES  # ChatAgent: a larger request body gets 413


@dataclass
class Dropped:
    """A rollout that produced nothing trainable; the pool counts `rollout/dropped/<reason>`.

    Reasons: `agent_error` (the Env or ChatAgent raised), `generator_error` (the engine call
    failed, Env form), `deadline`, `bad_result` (not a Result, or a non-finite reward),
    `bad_row` (no prompt, or the chat template rejects it), `prompt_too_long`, `empty` (a
    ChatAgent that never called the model), `session_busy` (a ChatAgent returned with a model
    call still running). `detail` says what happened, for the log.
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


# ---- loading a user module ---------------------------------------------------------------


class AgentLoadError(ValueError):
    """The agent module is missing, fails to import, or does not follow the contract."""


def load_agent(path_or_module: str) -> type:
    """Import a module by file path (`my_agent.py`) or dotted name (`pkg.agent`) and return its
    `AgentRunner` class after checking it; every problem found is named in one error."""
    module = _import(path_or_module)
    runner = getattr(module, "AgentRunner", None)
    if runner is None:
        raise AgentLoadError(
            f"{path_or_module} does not define AgentRunner (a subclass of EnvRunner or ChatRunner)"
        )
    problems = agent_problems(runner)
    if problems:
        raise AgentLoadError(f"{path_or_module}: " + "; ".join(problems))
    return runner


def agent_problems(runner: Any) -> list[str]:
    """What is wrong with an AgentRunner class, one sentence each (empty when it is fine)."""
    from .chat_runner import ChatRunner
    from .env_runner import EnvRunner

    if not isinstance(runner, type) or not issubclass(runner, EnvRunner | ChatRunner):
        return [f"AgentRunner must be a subclass of EnvRunner or ChatRunner, got {runner!r}"]
    if issubclass(runner, EnvRunner):
        attr, base, methods = "env_class", Env, ("reset", "step")
    else:
        attr, base, methods = "agent_class", ChatAgent, ("run",)
    cls = getattr(runner, attr, None)
    if not isinstance(cls, type):
        return [f"AgentRunner.{attr} must be set to your {base.__name__} class, got {cls!r}"]
    problems = []
    for name in methods:
        method = getattr(cls, name, None)
        # The base class's `step`/`run` only raises NotImplementedError: it must be overridden.
        if method is None or (name != "reset" and method is getattr(base, name)):
            problems.append(f"{cls.__name__} does not define {name}()")
        elif not inspect.iscoroutinefunction(method):
            problems.append(f"{cls.__name__}.{name} must be async (async def {name}(...))")
    return problems


def _import(path_or_module: str):
    path = Path(path_or_module)
    if path.suffix == ".py" or "/" in path_or_module:
        if not path.is_file():
            raise AgentLoadError(f"agent file {path} does not exist")
        name = f"molt_agent_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up by name
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise AgentLoadError(f"importing {path} failed: {type(e).__name__}: {e}") from e
        return module
    try:
        return importlib.import_module(path_or_module)
    except ModuleNotFoundError as e:
        if e.name and path_or_module.startswith(e.name):
            raise AgentLoadError(f"no module named {path_or_module!r}") from e
        raise AgentLoadError(f"importing {path_or_module} failed: {e}") from e
    except Exception as e:
        raise AgentLoadError(f"importing {path_or_module} failed: {type(e).__name__}: {e}") from e
