"""OpenAI Chat Completions: a request into a `ChatRequest`; the reply, whole or as SSE chunks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import Field

from . import wire
from .errors import CaptureError
from .render import assistant_message, tool_call_message
from .session import ChatRequest, TurnResult


class Text(wire.TextPart):
    type: Literal["text"]


class ImageURL(wire.WireModel):
    url: str  # `detail` is ignored: the model's processor decides the resolution


class Image(wire.ImagePart):
    type: Literal["image_url"]
    image_url: ImageURL

    def url(self) -> str:
        return self.image_url.url


class FunctionCall(wire.WireModel):
    name: str
    arguments: str = "{}"


class ToolCallIn(wire.WireModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(wire.WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[Text | Image, Field(discriminator="type")]] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for the same field


class Tool(wire.WireModel):
    type: Literal["function"]
    function: wire.FunctionDef


class CompletionRequest(wire.WireRequest):
    # Harmless: none changes what is sampled. `seed` is the framework's (set when the run seeds);
    # `logprobs` are not returned; `verbosity`, `reasoning_effort` follow the model and template;
    # `prediction` (speculative decoding) only changes speed; `audio` needs `modalities` (refused).
    IGNORED = frozenset(
        {"model", "user", "seed", "metadata", "store", "service_tier", "safety_identifier"}
        | {"prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "moderation"}
        | {"parallel_tool_calls", "logprobs", "top_logprobs", "reasoning_effort", "verbosity"}
        | {"prediction", "audio"}
    )
    REFUSED = wire.SAMPLING_REFUSED | {
        "n": ((1,), "n > 1 is not supported: the framework owns the group size"),
        "response_format": (({"type": "text"},), wire.STRUCTURED_OUTPUT_REFUSED),
        "functions": (([],), "deprecated and not supported: use tools"),
        "function_call": (("auto", "none"), "deprecated and not supported: use tool_choice"),
        "modalities": ((["text"],), "only text output is supported"),
        "web_search_options": ((), wire.UNSERVED),
    }
    # Each message is validated on its own (in `parse_request`): the validator holds the GIL,
    # and one call over 100k messages would hold the event loop as long.
    messages: list[Any] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream_options: dict[str, bool] | None = None  # `include_usage`


def parse_request(raw: bytes, images: bool) -> tuple[CompletionRequest, ChatRequest]:
    req = wire.parse(CompletionRequest, raw)
    tools = [
        t.function.template(f"tools.{i}.function.parameters") for i, t in enumerate(req.tools or [])
    ]
    messages = [_to_template(m, f"messages.{i}", images) for i, m in enumerate(req.messages)]
    wire.check_tool_results(messages, [f"messages.{i}.tool_call_id" for i in range(len(messages))])
    names = {"max_tokens": "max_completion_tokens" if req.max_completion_tokens else "max_tokens"}
    max_tokens = req.max_completion_tokens or req.max_tokens
    return req, req.chat(messages, tools, req.tool_choice, max_tokens, req.stop, names)


def _to_template(raw: Any, at: str, images: bool) -> dict[str, Any]:
    m = wire.parse(Message, raw, at)
    content = wire.content(m.content, f"{at}.content", images)
    if m.role == "assistant":
        calls = []
        for j, c in enumerate(m.tool_calls or []):
            args = wire.arguments(c.function.arguments, f"{at}.tool_calls.{j}.function.arguments")
            calls.append(tool_call_message(c.function.name, args, c.id))
        return assistant_message(content, m.reasoning_content or m.reasoning, calls)
    if m.content is None:
        raise wire.refuse(f"{at}.content", f"required for a {m.role} message")
    if m.role == "tool" and m.tool_call_id is None:
        raise wire.refuse(f"{at}.tool_call_id", "required for a tool message")
    role = "system" if m.role == "developer" else m.role
    answers = {"tool_call_id": m.tool_call_id} if m.role == "tool" else {}
    return {"role": role, "content": content, **answers}


def reply(req: CompletionRequest, chat: ChatRequest, result: TurnResult, model: str) -> dict:
    r = result.reply
    calls = [
        {"id": c.id, "type": "function", "function": wire.function_call(c)} for c in r.tool_calls
    ]
    msg = assistant_message(r.content, r.reasoning, calls)
    usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens}
    usage["total_tokens"] = result.prompt_tokens + result.completion_tokens
    choice = {"index": 0, "message": msg, "finish_reason": result.finish_reason, "logprobs": None}
    return {
        "id": wire.new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def stream(req: CompletionRequest, body: dict[str, Any]) -> Iterator[str]:
    """The chunks the SDK's stream helpers expect, in their order."""
    head = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    (choice,) = body["choices"]
    msg = choice["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        choices = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        return wire.sse({**head, "choices": choices}, named=False)

    yield chunk({"role": "assistant", "content": ""})
    if "reasoning_content" in msg:
        yield chunk({"reasoning_content": msg["reasoning_content"]})
    if msg["content"]:
        yield chunk({"content": msg["content"]})
    for i, call in enumerate(msg.get("tool_calls", [])):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, choice["finish_reason"])
    if (req.stream_options or {}).get("include_usage"):
        yield wire.sse({**head, "choices": [], "usage": body["usage"]}, named=False)
    yield "data: [DONE]\n\n"


def error_body(e: CaptureError) -> dict[str, Any]:
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.status}}


def models(model: str) -> dict[str, Any]:
    """One listing both SDKs can read (OpenAI's list object, Anthropic's page fields)."""
    entry = {"id": model, "object": "model", "created": 0, "owned_by": "molt", "type": "model"}
    entry |= {"display_name": model, "created_at": "1970-01-01T00:00:00Z"}
    page = {"has_more": False, "first_id": model, "last_id": model}
    return {"object": "list", "data": [entry], **page}
