"""OpenAI Chat Completions: request validation into a `ChatRequest`, replies and SSE chunks.

Fields that would change what is sampled in ways the trace cannot record (n > 1, penalties,
forced tool choice, structured output) are refused with 400; harmless ones are ignored.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import Field

from .errors import CaptureError
from .render import Reply, tool_call_message
from .session import ChatRequest, TurnResult
from .wire import (
    SamplingExtras,
    arguments,
    check_tool_results,
    parse,
    refuse_structured_output,
    refuse_tool_choice,
    tool_schema,
)
from .wire import WireModel as _Model


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImageURL(_Model):
    url: str  # a data URL or a local file (molt_capture.media.load_image)
    detail: str | None = None  # ignored: the model's processor decides the resolution


class ImagePart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(_Model):
    name: str
    arguments: str = "{}"


class ToolCallIn(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for the same field


class ImageMessage(Message):
    """A message of a request to a multimodal model: content parts may be images too."""

    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None


class FunctionDef(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Model):
    include_usage: bool = False


class CompletionRequest(SamplingExtras):
    # Each message is validated on its own (in `parse_request`): the validator holds the GIL,
    # and one call over 100k messages would hold the event loop as long.
    messages: list[Any] = Field(min_length=1)
    model: str | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None


def parse_request(raw: bytes, images: bool = False) -> tuple[CompletionRequest, ChatRequest]:
    """`images`: the server's model takes them (`image_url` parts); else they get a 400."""
    req = parse(CompletionRequest, raw)
    if req.n not in (None, 1):
        raise CaptureError(400, "n > 1 is not supported: the framework owns the group size", "n")
    req.refuse_sampling_extras()
    if req.response_format and req.response_format.get("type") != "text":
        raise refuse_structured_output("response_format")
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    refuse_tool_choice(choice if isinstance(choice, str) else "named")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    for i, t in enumerate(req.tools or []):
        tool_schema(t.function.parameters, f"tools.{i}.function.parameters")
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
    model = ImageMessage if images else Message
    messages = [
        _to_template(parse(model, m, f"messages.{i}"), i) for i, m in enumerate(req.messages)
    ]
    check_tool_results(messages, [f"messages.{i}.tool_call_id" for i in range(len(messages))])
    max_tokens = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    chat = ChatRequest(
        messages=messages,
        tools=tools,
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_completion_tokens or req.max_tokens,
        stop=stop,
        parse_tools=choice != "none",
        param_names={"max_tokens": max_tokens},
    )
    return req, chat


def _text(content: str | list[TextPart | ImagePart] | None) -> str | list[dict[str, Any]]:
    """Text parts joined; with an image among them, the parts in template form (the chat
    template writes each image's token where its part is)."""
    if isinstance(content, list):
        if any(isinstance(p, ImagePart) for p in content):
            return [
                {"type": "image_url", "image_url": {"url": p.image_url.url}}
                if isinstance(p, ImagePart)
                else {"type": "text", "text": p.text}
                for p in content
            ]
        return "".join(p.text for p in content)
    return content or ""


def _to_template(m: Message, i: int) -> dict[str, Any]:
    role = "system" if m.role == "developer" else m.role
    if m.content is None and m.role != "assistant":
        where = f"messages.{i}.content"
        raise CaptureError(400, f"{where} is required for a {m.role} message", where)
    msg: dict[str, Any] = {"role": role, "content": _text(m.content)}
    if m.role == "tool":
        if m.tool_call_id is None:
            raise CaptureError(
                400,
                f"messages.{i}.tool_call_id is required for a tool message",
                f"messages.{i}.tool_call_id",
            )
        msg["tool_call_id"] = m.tool_call_id
    if m.role == "assistant":
        if m.reasoning_content or m.reasoning:
            msg["reasoning_content"] = m.reasoning_content or m.reasoning
        calls = []
        for j, tc in enumerate(m.tool_calls or []):
            args = arguments(
                tc.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments"
            )
            calls.append(tool_call_message(tc.function.name, args, tc.id))
        if calls:
            msg["tool_calls"] = calls
    return msg


def _message(reply: Reply) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning:
        msg["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        msg["tool_calls"] = [
            {
                "id": tc.id,
                "type": "function",
                "function": {"name": tc.name, "arguments": json.dumps(tc.arguments)},
            }
            for tc in reply.tool_calls
        ]
    return msg


def _usage(r: TurnResult) -> dict[str, int]:
    total = r.prompt_tokens + r.completion_tokens
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": total,
    }


def completion(result: TurnResult, model: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": _message(result.reply),
                "finish_reason": result.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": _usage(result),
    }


def stream(result: TurnResult, model: str, include_usage: bool) -> Iterator[str]:
    """The SSE chunks the SDK's stream helpers expect: role, reasoning, content, tool calls,
    finish reason, optional usage, [DONE]. The generator answers whole turns, so the deltas
    are emitted together once the turn is done."""
    base = {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        body = {
            **base,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }
        return f"data: {json.dumps(body)}\n\n"

    reply = result.reply
    yield chunk({"role": "assistant", "content": ""})
    if reply.reasoning:
        yield chunk({"reasoning_content": reply.reasoning})
    if reply.content:
        yield chunk({"content": reply.content})
    for i, tc in enumerate(reply.tool_calls):
        fn = {"name": tc.name, "arguments": json.dumps(tc.arguments)}
        yield chunk({"tool_calls": [{"index": i, "id": tc.id, "type": "function", "function": fn}]})
    yield chunk({}, result.finish_reason)
    if include_usage:
        yield f"data: {json.dumps({**base, 'choices': [], 'usage': _usage(result)})}\n\n"
    yield "data: [DONE]\n\n"


def error_body(e: CaptureError) -> dict[str, Any]:
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.status}}


def models(model: str) -> dict[str, Any]:
    """One listing both SDKs can read (OpenAI's list object, Anthropic's page fields)."""
    entry = {
        "id": model,
        "object": "model",
        "created": 0,
        "owned_by": "molt",
        "type": "model",
        "display_name": model,
        "created_at": "1970-01-01T00:00:00Z",
    }
    return {
        "object": "list",
        "data": [entry],
        "has_more": False,
        "first_id": model,
        "last_id": model,
    }
