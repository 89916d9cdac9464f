"""Anthropic Messages: request validation into a `ChatRequest`, replies and SSE events.

Content blocks map onto chat-template messages: `tool_result` blocks become `tool` messages
(in order, before any text of the same user turn), `thinking` becomes `reasoning_content`,
`tool_use` becomes a tool call. Forced tool choice and `top_k` are refused with 400.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import Field

from .errors import CaptureError
from .render import Reply, tool_call_message
from .session import ChatRequest, TurnResult
from .wire import (
    SamplingExtras,
    check_tool_results,
    parse,
    refuse_structured_output,
    refuse_tool_choice,
    tool_schema,
)
from .wire import WireModel as _Model


class TextBlock(_Model):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Model):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Model):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


Block = Annotated[
    TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock,
    Field(discriminator="type"),
]


class ImageSource(_Model):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None  # a data URL or a local file (molt_capture.media.load_image)

    def as_source(self) -> str:
        if self.type == "base64":
            return f"data:{self.media_type or 'image/png'};base64,{self.data or ''}"
        return self.url or ""


class ImageBlock(_Model):
    type: Literal["image"]
    source: ImageSource


ImageAwareBlock = Annotated[
    TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock | ImageBlock,
    Field(discriminator="type"),
]


class Message(_Model):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ImageMessage(Message):
    """A message of a request to a multimodal model: user turns may hold image blocks."""

    content: str | list[ImageAwareBlock]


class Tool(_Model):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Model):
    type: Literal["auto", "none", "any", "tool"]


class MessagesRequest(SamplingExtras):
    max_tokens: int = Field(ge=1)
    messages: list[Any] = Field(min_length=1)  # validated one by one, as on the OpenAI wire
    model: str | None = None
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    output_format: dict[str, Any] | None = None  # structured outputs (beta)


class CountTokensRequest(_Model):
    messages: list[Any] = Field(min_length=1)  # validated one by one, as on the OpenAI wire
    model: str | None = None
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None


def parse_request(raw: bytes, images: bool = False) -> tuple[MessagesRequest, ChatRequest]:
    """`images`: the server's model takes them (image blocks); else they get a 400."""
    req = parse(MessagesRequest, raw)
    req.refuse_sampling_extras()
    if req.output_format is not None:
        raise refuse_structured_output("output_format")
    choice = req.tool_choice.type if req.tool_choice else "auto"
    refuse_tool_choice(choice)
    chat = ChatRequest(
        messages=to_template(req.system, req.messages, images),
        tools=convert_tools(req.tools),
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_tokens,
        stop=list(req.stop_sequences or []),
        parse_tools=choice != "none",
        param_names={"stop": "stop_sequences"},
    )
    return req, chat


def parse_count_request(raw: bytes) -> ChatRequest:
    req = parse(CountTokensRequest, raw)
    return ChatRequest(
        messages=to_template(req.system, req.messages), tools=convert_tools(req.tools)
    )


def convert_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """Anthropic's `input_schema` is the JSON schema OpenAI calls `parameters`."""
    out = []
    for i, t in enumerate(tools or []):
        tool_schema(t.input_schema, f"tools.{i}.input_schema")
        fn: dict[str, Any] = {"name": t.name}
        if t.description is not None:
            fn["description"] = t.description
        fn["parameters"] = t.input_schema
        out.append({"type": "function", "function": fn})
    return out or None


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def to_template(
    system: str | list[TextBlock] | None, messages: list[Any], images: bool = False
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    origin: list[str] = []  # each template message's field, for the tool-result check
    if system:
        out.append({"role": "system", "content": _text(system)})
        origin.append("system")
    for i, raw in enumerate(messages):
        m = parse(ImageMessage if images else Message, raw, f"messages.{i}")
        blocks = (
            [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        )
        if m.role == "user":
            texts: list[str] = []
            parts: list[dict[str, Any]] = []  # in template form, once an image is among them
            for j, b in enumerate(blocks):
                if isinstance(b, ToolResultBlock):
                    out.append(
                        {"role": "tool", "content": _text(b.content), "tool_call_id": b.tool_use_id}
                    )
                    origin.append(f"messages.{i}.content.{j}.tool_use_id")
                elif isinstance(b, TextBlock):
                    texts.append(b.text)
                    parts.append({"type": "text", "text": b.text})
                elif isinstance(b, ImageBlock):
                    parts.append({"type": "image", "image": b.source.as_source()})
                else:
                    where = f"messages.{i}.content.{j}"
                    raise CaptureError(
                        400, f"{where}: a user turn cannot hold a {b.type} block", where
                    )
            if len(parts) > len(texts):  # an image: the parts, for the processor
                out.append({"role": "user", "content": parts})
                origin.append(f"messages.{i}")
            elif texts or not any(isinstance(b, ToolResultBlock) for b in blocks):
                out.append({"role": "user", "content": "".join(texts)})
                origin.append(f"messages.{i}")
            continue
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        calls = []
        for j, b in enumerate(blocks):
            if isinstance(b, TextBlock):
                msg["content"] += b.text
            elif isinstance(b, ThinkingBlock):
                msg["reasoning_content"] = b.thinking
            elif isinstance(b, ToolUseBlock):
                calls.append(tool_call_message(b.name, b.input, b.id))
            elif isinstance(b, ToolResultBlock):
                where = f"messages.{i}.content.{j}"
                raise CaptureError(
                    400, f"{where}: an assistant turn cannot hold a tool_result block", where
                )
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
        origin.append(f"messages.{i}")
    check_tool_results(out, origin)
    return out


def _stop_reason(result: TurnResult) -> str:
    if result.finish_reason == "length":
        return "max_tokens"
    if result.finish_reason == "tool_calls":
        return "tool_use"
    return "stop_sequence" if result.stop_sequence else "end_turn"


def _blocks(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.reasoning:
        # The signature is opaque to clients; it only has to round-trip, which it need not here.
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": "molt"})
    if reply.content or not reply.tool_calls:
        blocks.append({"type": "text", "text": reply.content})
    for tc in reply.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": tc.id.replace("call_", "toolu_"),
                "name": tc.name,
                "input": tc.arguments,
            }
        )
    return blocks


def message(result: TurnResult, model: str, msg_id: str | None = None) -> dict[str, Any]:
    return {
        "id": msg_id or f"msg_{secrets.token_hex(12)}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _blocks(result.reply),
        "stop_reason": _stop_reason(result),
        "stop_sequence": result.stop_sequence,
        "usage": {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens},
    }


def stream(result: TurnResult, model: str) -> Iterator[str]:
    """message_start, then per block start/delta/stop, then message_delta and message_stop."""

    def event(kind: str, data: dict[str, Any]) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    full = message(result, model)
    start = {**full, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {"input_tokens": result.prompt_tokens, "output_tokens": 0}
    yield event("message_start", {"message": start})
    for i, block in enumerate(full["content"]):
        kind = block["type"]
        if kind == "thinking":
            yield event(
                "content_block_start",
                {
                    "index": i,
                    "content_block": {"type": "thinking", "thinking": "", "signature": ""},
                },
            )
            yield event(
                "content_block_delta",
                {"index": i, "delta": {"type": "thinking_delta", "thinking": block["thinking"]}},
            )
            yield event(
                "content_block_delta",
                {"index": i, "delta": {"type": "signature_delta", "signature": block["signature"]}},
            )
        elif kind == "text":
            yield event(
                "content_block_start", {"index": i, "content_block": {"type": "text", "text": ""}}
            )
            if block["text"]:
                yield event(
                    "content_block_delta",
                    {"index": i, "delta": {"type": "text_delta", "text": block["text"]}},
                )
        else:
            empty = {**block, "input": {}}
            yield event("content_block_start", {"index": i, "content_block": empty})
            partial = json.dumps(block["input"])
            yield event(
                "content_block_delta",
                {"index": i, "delta": {"type": "input_json_delta", "partial_json": partial}},
            )
        yield event("content_block_stop", {"index": i})
    delta = {"stop_reason": full["stop_reason"], "stop_sequence": full["stop_sequence"]}
    yield event(
        "message_delta", {"delta": delta, "usage": {"output_tokens": result.completion_tokens}}
    )
    yield event("message_stop", {})


def error_body(e: CaptureError) -> dict[str, Any]:
    kinds = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "request_too_large",
    }
    kind = kinds.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}
