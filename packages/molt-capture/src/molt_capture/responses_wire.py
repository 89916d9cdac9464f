"""OpenAI Responses: input items into a `ChatRequest`, the response object and its SSE events.

Input items map onto chat-template messages: consecutive `reasoning`, assistant `message` and
`function_call` items are one assistant turn (reasoning, content, tool calls, in the order the
API emits them); `function_call_output` is a `tool` message; `instructions` is the system
message. `previous_response_id` names an earlier response of the same session: its
conversation (without its instructions, as the API defines) comes before the new input.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from .errors import CaptureError
from .render import Reply, tool_call_message
from .session import ChatRequest, TurnResult
from .wire import (
    SamplingExtras,
    WireModel,
    arguments,
    check_tool_results,
    parse,
    refuse_structured_output,
    refuse_tool_choice,
    tool_schema,
)


class TextPart(WireModel):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(WireModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class ImagePart(WireModel):
    type: Literal["input_image"]
    image_url: str  # a data URL or a local file (molt_capture.media.load_image); no file ids
    detail: str | None = None  # ignored: the model's processor decides the resolution


class ImageMessageItem(MessageItem):
    """A message item of a request to a multimodal model: its parts may be images too."""

    content: str | list[TextPart | ImagePart]


class FunctionCallItem(WireModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(WireModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningText(WireModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(WireModel):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEMS: dict[str, type[Item]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class FunctionTool(WireModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # ignored: no constrained decoding; the schema reaches the model


class TextConfig(WireModel):
    format: dict[str, Any] | None = None


class ResponsesRequest(SamplingExtras):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_output_tokens: int | None = Field(None, ge=1)
    previous_response_id: str | None = None
    stream: bool = False
    text: TextConfig | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None


@dataclass
class Parsed:
    request: ResponsesRequest
    chat: ChatRequest
    conversation: list[dict[str, Any]]  # the messages after the instructions, for follow-ups


def parse_request(raw: bytes, responses: dict[str, list[dict]], images: bool = False) -> Parsed:
    """`responses` is the session's earlier responses (id -> conversation). `images`: the
    server's model takes them (`input_image` parts); else they get a 400."""
    req = parse(ResponsesRequest, raw)
    req.refuse_sampling_extras()
    for name in ("background", "conversation", "prompt"):
        if getattr(req, name):
            raise CaptureError(400, f"{name} is not supported by this server", name)
    fmt = (req.text.format if req.text else None) or {"type": "text"}
    if fmt.get("type") != "text":
        raise refuse_structured_output("text.format")
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    refuse_tool_choice(choice if isinstance(choice, str) else str(choice.get("type")))
    tools = [_tool(t, i) for i, t in enumerate(req.tools or [])] or None
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        if req.previous_response_id not in responses:
            raise CaptureError(
                400,
                f"previous_response_id {req.previous_response_id!r} is not a response of this "
                "session",
                "previous_response_id",
            )
        history = responses[req.previous_response_id]
    new, where = _to_template(req.input, images)
    if not new:
        raise CaptureError(400, "input must hold at least one item", "input")
    conversation = [*history, *new]
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    check_tool_results(conversation, ["previous_response_id"] * len(history) + where)
    chat = ChatRequest(
        messages=[*system, *conversation],
        tools=tools,
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_output_tokens,
        parse_tools=choice != "none",
        param_names={"max_tokens": "max_output_tokens"},
    )
    return Parsed(req, chat, conversation)


def _tool(raw: dict[str, Any], i: int) -> dict[str, Any]:
    if raw.get("type") != "function":
        where = f"tools.{i}.type"
        raise CaptureError(400, f"{where}: only function tools are supported", where)
    t = parse(FunctionTool, raw, f"tools.{i}")
    tool_schema(t.parameters, f"tools.{i}.parameters")
    fn = t.model_dump(exclude_none=True, exclude={"type", "strict"})
    return {"type": "function", "function": fn}


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _content(content: str | list[TextPart | ImagePart]) -> str | list[dict[str, Any]]:
    """Text joined; with an image among the parts, the parts in template form."""
    if isinstance(content, list) and any(isinstance(p, ImagePart) for p in content):
        return [
            {"type": "image_url", "image_url": {"url": p.image_url}}
            if isinstance(p, ImagePart)
            else {"type": "text", "text": p.text}
            for p in content
        ]
    return _text(content)


def _item(raw: Any, i: int, images: bool = False) -> Item:
    kind = raw.get("type", "message") if isinstance(raw, dict) else None
    model = ITEMS.get(kind) if isinstance(kind, str) else None
    if images and model is MessageItem:
        model = ImageMessageItem
    if model is None:
        where = f"input.{i}"
        raise CaptureError(
            400, f"{where}: item type {kind!r} is not supported by this server", where
        )
    return parse(model, raw, f"input.{i}")


def _to_template(
    items: str | list[dict[str, Any]], images: bool = False
) -> tuple[list[dict[str, Any]], list[str]]:
    """Template messages, and the input field each came from."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], ["input"]
    out: list[dict[str, Any]] = []
    where: list[str] = []
    turn: dict[str, Any] | None = None  # the assistant turn being assembled
    for i, raw in enumerate(items):
        item = _item(raw, i, images)
        if isinstance(item, ReasoningItem | FunctionCallItem) or (
            isinstance(item, MessageItem) and item.role == "assistant"
        ):
            # A turn is reasoning, then text, then calls: reasoning or text after text or calls
            # starts the next turn.
            said = turn is not None and bool(turn["content"] or "tool_calls" in turn)
            if turn is None or (said and not isinstance(item, FunctionCallItem)):
                turn = {"role": "assistant", "content": ""}
                out.append(turn)
                where.append(f"input.{i}")
            if isinstance(item, ReasoningItem):
                parts = item.content if item.content is not None else item.summary
                texts = [turn.get("reasoning_content"), *(p.text for p in parts)]
                turn["reasoning_content"] = "\n\n".join(t for t in texts if t)
            elif isinstance(item, FunctionCallItem):
                args = arguments(item.arguments, f"input.{i}.arguments")
                call = tool_call_message(item.name, args, item.call_id)
                turn.setdefault("tool_calls", []).append(call)
            else:
                turn["content"] = _text(item.content)
            continue
        turn = None
        if isinstance(item, FunctionCallOutputItem):
            out.append(
                {"role": "tool", "content": _text(item.output), "tool_call_id": item.call_id}
            )
            where.append(f"input.{i}.call_id")
        else:
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _content(item.content)})
            where.append(f"input.{i}")
    return out, where


# ---- replies ------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def output_items(reply: Reply) -> list[dict[str, Any]]:
    """Reasoning, then the message, then one item per tool call, as the API orders them."""
    items: list[dict[str, Any]] = []
    if reply.reasoning:
        items.append(
            {
                "type": "reasoning",
                "id": _id("rs"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reply.reasoning}],
            }
        )
    if reply.content or not reply.tool_calls:
        items.append(
            {
                "type": "message",
                "id": _id("msg"),
                "role": "assistant",
                "status": "completed",
                "content": [
                    {
                        "type": "output_text",
                        "text": reply.content,
                        "annotations": [],
                        "logprobs": [],
                    }
                ],
            }
        )
    for tc in reply.tool_calls:
        items.append(
            {
                "type": "function_call",
                "id": _id("fc"),
                "call_id": tc.id,
                "name": tc.name,
                "arguments": json.dumps(tc.arguments),
                "status": "completed",
            }
        )
    return items


def response(parsed: Parsed, result: TurnResult, model: str) -> dict[str, Any]:
    req, chat = parsed.request, parsed.chat
    incomplete = result.finish_reason == "length"
    usage = {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }
    return {
        "id": _id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": model,
        "instructions": req.instructions,
        "output": output_items(result.reply),
        "parallel_tool_calls": True,
        "previous_response_id": req.previous_response_id,
        "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) else "auto",
        "tools": [{"type": "function", **t["function"]} for t in chat.tools or []],
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": {},
        "usage": usage,
    }


def stream(resp: dict[str, Any]) -> Iterator[str]:
    """The event sequence the SDK's stream accumulator expects: created, in_progress, per
    item added / deltas / done, then completed (or incomplete). The generator answers whole
    turns, so the deltas are sent together once the turn is done."""
    seq = iter(range(1_000_000))

    def event(kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": next(seq), **data}
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    pending = {**resp, "status": "in_progress", "output": [], "usage": None}
    pending["incomplete_details"] = None
    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    for i, item in enumerate(resp["output"]):
        at = {"item_id": item["id"], "output_index": i}
        if item["type"] == "function_call":
            yield event(
                "response.output_item.added", output_index=i, item={**item, "arguments": ""}
            )
            yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            yield event(
                "response.function_call_arguments.done",
                **at,
                name=item["name"],
                arguments=item["arguments"],
            )
        else:
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            yield event("response.output_item.added", output_index=i, item={**item, "content": []})
            for j, part in enumerate(item["content"]):
                empty = {**part, "text": ""}
                extra = {"logprobs": []} if kind == "output_text" else {}
                yield event("response.content_part.added", **at, content_index=j, part=empty)
                yield event(
                    f"response.{kind}.delta", **at, content_index=j, delta=part["text"], **extra
                )
                yield event(
                    f"response.{kind}.done", **at, content_index=j, text=part["text"], **extra
                )
                yield event("response.content_part.done", **at, content_index=j, part=part)
        yield event("response.output_item.done", output_index=i, item=item)
    done = "response.incomplete" if resp["status"] == "incomplete" else "response.completed"
    yield event(done, response=resp)
