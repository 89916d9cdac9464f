"""Anthropic Messages: a request into a `ChatRequest`; the reply, whole or as SSE events.
`tool_result` blocks become `tool` messages, before any text of the same user turn."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import Field

from . import wire
from .errors import CaptureError
from .render import assistant_message, tool_call_message
from .session import ChatRequest, TurnResult


class Text(wire.TextPart):
    type: Literal["text"]


class Thinking(wire.WireModel):
    type: Literal["thinking"]
    thinking: str  # its `signature` is opaque and ignored


class RedactedThinking(wire.WireModel):
    type: Literal["redacted_thinking"]
    data: str


class ToolUse(wire.WireModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResult(wire.WireModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Text] = ""  # `is_error` is ignored: the content says what happened


class ImageSource(wire.WireModel):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class Image(wire.ImagePart):
    type: Literal["image"]
    source: ImageSource

    def url(self) -> str:
        s = self.source
        inline = f"data:{s.media_type or 'image/png'};base64,{s.data or ''}"
        return inline if s.type == "base64" else s.url or ""


Block = Text | Thinking | RedactedThinking | ToolUse | ToolResult | Image


class Message(wire.WireModel):
    role: Literal["user", "assistant"]
    content: str | list[Annotated[Block, Field(discriminator="type")]]


class Tool(wire.FunctionDef):
    parameters: dict[str, Any] = Field(alias="input_schema")


class CountTokensRequest(wire.WireModel):
    messages: list[Any] = Field(min_length=1)  # validated one by one, as on the OpenAI wire
    system: str | list[Text] | None = None
    tools: list[Tool] | None = None


class MessagesRequest(wire.WireRequest, CountTokensRequest):
    # Harmless: none changes what is sampled. `thinking` and `output_config.effort` follow the
    # model and `chat_template_kwargs`; `speed` and the rest concern the service, not the model.
    IGNORED = frozenset(
        {"model", "metadata", "thinking", "cache_control", "container", "diagnostics"}
        | {"inference_geo", "service_tier", "speed", "user_profile_id", "workspace_id"}
    )
    REFUSED = wire.SAMPLING_REFUSED | {
        "output_config.format": ((), wire.STRUCTURED_OUTPUT_REFUSED),
        "output_format": ((), wire.STRUCTURED_OUTPUT_REFUSED),  # its older name
    }
    temperature: float | None = Field(None, ge=0, le=1)
    max_tokens: int = Field(ge=1)
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None


def parse_request(raw: bytes, images: bool) -> tuple[MessagesRequest, ChatRequest]:
    req = wire.parse(MessagesRequest, raw)
    messages, names = to_template(req, images), {"stop": "stop_sequences"}
    choice, stop = req.tool_choice, req.stop_sequences
    return req, req.chat(messages, _tools(req), choice, req.max_tokens, stop, names)


def parse_count_request(raw: bytes) -> ChatRequest:
    req = wire.parse(CountTokensRequest, raw)
    return ChatRequest(to_template(req, images=False), _tools(req))


def _tools(req: CountTokensRequest) -> list[dict[str, Any]] | None:
    """Anthropic's `input_schema` is the JSON schema OpenAI calls `parameters`."""
    return [t.template(f"tools.{i}.input_schema") for i, t in enumerate(req.tools or [])] or None


def to_template(req: CountTokensRequest, images: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    origin: list[str] = []  # each template message's field, for the tool-result check
    if req.system:
        out.append({"role": "system", "content": wire.content(req.system, "system", False)})
        origin.append("system")
    for i, raw in enumerate(req.messages):
        at = f"messages.{i}"
        m = wire.parse(Message, raw, at)
        blocks = m.content if isinstance(m.content, list) else [Text(type="text", text=m.content)]
        user = m.role == "user"
        for j, b in enumerate(blocks):
            if isinstance(b, Thinking | RedactedThinking | ToolUse if user else ToolResult | Image):
                turn = "a user" if user else "an assistant"
                raise wire.refuse(f"{at}.content.{j}", f"{turn} turn cannot hold a {b.type} block")
            if isinstance(b, ToolResult):
                tool_content = wire.content(b.content, f"{at}.content.{j}.content", False)
                out.append({"role": "tool", "content": tool_content, "tool_call_id": b.tool_use_id})
                origin.append(f"{at}.content.{j}.tool_use_id")
        if user and blocks and all(isinstance(b, ToolResult) for b in blocks):
            continue  # tool results alone: no user message of their own
        if user:
            out.append({"role": "user", "content": wire.content(blocks, f"{at}.content", images)})
        else:
            out.append(_assistant(blocks))
        origin.append(at)
    wire.check_tool_results(out, origin)
    return out


def _assistant(blocks: list) -> dict[str, Any]:
    text = "".join(b.text for b in blocks if isinstance(b, Text))
    thinking = [b.thinking for b in blocks if isinstance(b, Thinking)]
    calls = [tool_call_message(b.name, b.input, b.id) for b in blocks if isinstance(b, ToolUse)]
    return assistant_message(text, thinking[-1] if thinking else None, calls)


def reply(req: MessagesRequest, chat: ChatRequest, result: TurnResult, model: str) -> dict:
    r = result.reply
    blocks: list[dict[str, Any]] = []
    if r.reasoning:
        # The signature is opaque to clients; it only has to round-trip, which it need not here.
        blocks.append({"type": "thinking", "thinking": r.reasoning, "signature": "molt"})
    if r.content or not r.tool_calls:
        blocks.append({"type": "text", "text": r.content})
    for tc in r.tool_calls:
        tool_id = tc.id.replace("call_", "toolu_")
        blocks.append({"type": "tool_use", "id": tool_id, "name": tc.name, "input": tc.arguments})
    stop = {"length": "max_tokens", "tool_calls": "tool_use"}.get(result.finish_reason)
    return {
        "id": wire.new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop or ("stop_sequence" if result.stop_sequence else "end_turn"),
        "stop_sequence": result.stop_sequence,
        "usage": {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens},
    }


# A content block as its start event announces it, before its deltas.
_EMPTY = {
    "thinking": {"thinking": "", "signature": ""},
    "text": {"text": ""},
    "tool_use": {"input": {}},
}


def _deltas(block: dict[str, Any]) -> list[dict[str, Any]]:
    if block["type"] == "thinking":
        thinking = {"type": "thinking_delta", "thinking": block["thinking"]}
        return [thinking, {"type": "signature_delta", "signature": block["signature"]}]
    if block["type"] == "tool_use":
        return [{"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
    return [{"type": "text_delta", "text": block["text"]}] if block["text"] else []


def stream(req: MessagesRequest, body: dict[str, Any]) -> Iterator[str]:
    """message_start, then per block start/deltas/stop, then message_delta and message_stop."""
    usage = {**body["usage"], "output_tokens": 0}
    start = {**body, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
    yield wire.sse({"type": "message_start", "message": start})
    for i, block in enumerate(body["content"]):
        empty = {**block, **_EMPTY[block["type"]]}
        yield wire.sse({"type": "content_block_start", "index": i, "content_block": empty})
        for delta in _deltas(block):
            yield wire.sse({"type": "content_block_delta", "index": i, "delta": delta})
        yield wire.sse({"type": "content_block_stop", "index": i})
    delta = {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]}
    usage = {"output_tokens": body["usage"]["output_tokens"]}
    yield wire.sse({"type": "message_delta", "delta": delta, "usage": usage})
    yield wire.sse({"type": "message_stop"})


def error_body(e: CaptureError) -> dict[str, Any]:
    kinds = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}
    kind = kinds.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}
