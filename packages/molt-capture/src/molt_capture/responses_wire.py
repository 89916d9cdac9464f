"""OpenAI Responses: input items into a `ChatRequest`; the response, whole or as SSE events.
Consecutive `reasoning`, assistant `message` and `function_call` items are one assistant turn."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import Field

from . import wire
from .openai_wire import error_body as error_body  # the same error shape as Chat Completions
from .render import tool_call_message
from .session import ChatRequest, TurnResult


class Text(wire.TextPart):
    type: Literal["input_text", "output_text"]


class Image(wire.ImagePart):
    type: Literal["input_image"]
    image_url: str  # no file ids; `detail` is ignored: the model's processor decides

    def url(self) -> str:
        return self.image_url


class MessageItem(wire.WireModel):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Annotated[Text | Image, Field(discriminator="type")]]


class FunctionCallItem(wire.WireModel):
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(wire.WireModel):
    call_id: str
    output: str | list[Text]


class ReasoningText(wire.TextPart):
    type: Literal["reasoning_text", "summary_text"]


class ReasoningItem(wire.WireModel):
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None


# Each item's model by its `type` (`message` when it has none), so no model checks `type` again.
ITEMS: dict[str, type[wire.WireModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class ResponsesRequest(wire.WireRequest):
    # Harmless: none changes what is sampled. Responses are kept for the session's life whatever
    # `store` says; `reasoning` follows the model and template; `max_tool_calls` and
    # `background_options` concern what is refused anyway; `text.verbosity` is ignored too.
    IGNORED = frozenset(
        {"model", "store", "include", "metadata", "user", "safety_identifier", "service_tier"}
        | {"prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "moderation"}
        | {"truncation", "reasoning", "parallel_tool_calls", "top_logprobs", "stream_options"}
        | {"image", "access_programs", "max_tool_calls", "background_options"}
    )
    REFUSED = wire.SAMPLING_REFUSED | {
        "text.format": (({"type": "text"},), wire.STRUCTURED_OUTPUT_REFUSED),
        "background": ((False,), wire.UNSERVED),
        "conversation": ((), wire.UNSERVED),
        "prompt": ((), wire.UNSERVED),
        "context_management": (([],), wire.UNSERVED),
    }
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    previous_response_id: str | None = None


def parse_request(
    raw: bytes, images: bool, responses: dict[str, list[dict]]
) -> tuple[ResponsesRequest, ChatRequest]:
    """`responses`: the session's earlier responses (id -> conversation)."""
    req = wire.parse(ResponsesRequest, raw)
    tools = [_tool(t, f"tools.{i}") for i, t in enumerate(req.tools or [])]
    history = responses.get(req.previous_response_id or "", [])
    if req.previous_response_id is not None and req.previous_response_id not in responses:
        why = f"{req.previous_response_id!r} is not a response of this session"
        raise wire.refuse("previous_response_id", why)
    new, where = _to_template(req.input, images)
    if not new:
        raise wire.refuse("input", "must hold at least one item")
    wire.check_tool_results([*history, *new], ["previous_response_id"] * len(history) + where)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages = [*system, *history, *new]
    names = {"max_tokens": "max_output_tokens"}
    return req, req.chat(messages, tools, req.tool_choice, req.max_output_tokens, None, names)


def conversation(req: ResponsesRequest, chat: ChatRequest, result: TurnResult) -> list[dict]:
    """What a follow-up naming this response continues from (instructions are not carried)."""
    return [*chat.messages[1 if req.instructions else 0 :], result.reply.as_message()]


def _tool(raw: dict[str, Any], where: str) -> dict[str, Any]:
    if raw.get("type") != "function":
        raise wire.refuse(f"{where}.type", "only function tools are supported")
    # `strict` is ignored (no constrained decoding): the schema reaches the model either way.
    return wire.parse(wire.FunctionDef, raw, where).template(f"{where}.parameters")


def _item(raw: Any, where: str) -> Any:
    kind = raw.get("type", "message") if isinstance(raw, dict) else None
    if not isinstance(kind, str) or kind not in ITEMS:
        raise wire.refuse(where, f"item type {kind!r} is not supported by this server")
    return wire.parse(ITEMS[kind], raw, where)


def _to_template(items: str | list, images: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """Template messages, and the input field each came from."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], ["input"]
    out: list[dict[str, Any]] = []
    where: list[str] = []
    turn: dict[str, Any] | None = None  # the assistant turn being assembled
    for i, raw in enumerate(items):
        at = f"input.{i}"
        item = _item(raw, at)
        if isinstance(item, FunctionCallOutputItem):
            turn = None
            output = wire.content(item.output, f"{at}.output", False)
            out.append({"role": "tool", "content": output, "tool_call_id": item.call_id})
            where.append(f"{at}.call_id")
            continue
        if isinstance(item, MessageItem) and item.role != "assistant":
            turn = None
            role = "system" if item.role == "developer" else item.role
            content = wire.content(item.content, f"{at}.content", images)
            out.append({"role": role, "content": content})
            where.append(at)
            continue
        # A turn is reasoning, then text, then calls: reasoning or text after text or calls
        # starts the next turn.
        said = turn is not None and bool(turn["content"] or "tool_calls" in turn)
        if turn is None or (said and not isinstance(item, FunctionCallItem)):
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
            where.append(at)
        if isinstance(item, ReasoningItem):
            parts = item.content if item.content is not None else item.summary
            texts = [turn.get("reasoning_content"), *(p.text for p in parts)]
            turn["reasoning_content"] = "\n\n".join(t for t in texts if t)
        elif isinstance(item, FunctionCallItem):
            args = wire.arguments(item.arguments, f"{at}.arguments")
            call = tool_call_message(item.name, args, item.call_id)
            turn.setdefault("tool_calls", []).append(call)
        else:
            turn["content"] = wire.content(item.content, f"{at}.content", False)
    return out, where


def _output(result: TurnResult) -> list[dict[str, Any]]:
    """Reasoning, then the message, then one item per tool call, as the API orders them."""
    r, items = result.reply, []
    if r.reasoning:
        reasoning = {"type": "reasoning", "id": wire.new_id("rs_"), "summary": []}
        items.append({**reasoning, "content": [{"type": "reasoning_text", "text": r.reasoning}]})
    if r.content or not r.tool_calls:
        text = {"type": "output_text", "text": r.content, "annotations": [], "logprobs": []}
        message = {"type": "message", "id": wire.new_id("msg_"), "role": "assistant"}
        items.append({**message, "status": "completed", "content": [text]})
    for tc in r.tool_calls:
        call = {"type": "function_call", "id": wire.new_id("fc_"), "call_id": tc.id}
        items.append({**call, **wire.function_call(tc), "status": "completed"})
    return items


def reply(req: ResponsesRequest, chat: ChatRequest, result: TurnResult, model: str) -> dict:
    incomplete = result.finish_reason == "length"
    usage = {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }
    echoed = {"instructions", "previous_response_id", "temperature", "top_p", "max_output_tokens"}
    return {
        "id": wire.new_id("resp_"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": model,
        "output": _output(result),
        "parallel_tool_calls": True,
        "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) else "auto",
        "tools": [{"type": "function", **t["function"]} for t in chat.tools or []],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": {},
        "usage": usage,
        **req.model_dump(include=echoed),
    }


def stream(req: ResponsesRequest, body: dict[str, Any]) -> Iterator[str]:
    """The events the SDK's stream accumulator expects, in their order."""
    seq = itertools.count()

    def event(kind: str, **data: Any) -> str:
        return wire.sse({"type": kind, "sequence_number": next(seq), **data})

    pending = {**body, "status": "in_progress", "output": [], "usage": None}
    pending["incomplete_details"] = None
    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    for i, item in enumerate(body["output"]):
        at = {"item_id": item["id"], "output_index": i}
        call = item["type"] == "function_call"
        empty = {**item, "arguments": ""} if call else {**item, "content": []}
        yield event("response.output_item.added", output_index=i, item=empty)
        if call:
            args = item["arguments"]
            yield event("response.function_call_arguments.delta", **at, delta=args)
            done = {"name": item["name"], "arguments": args}
            yield event("response.function_call_arguments.done", **at, **done)
        kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
        extra = {"logprobs": []} if kind == "output_text" else {}
        for j, part in enumerate(item.get("content", [])):
            at_part = {**at, "content_index": j}
            yield event("response.content_part.added", **at_part, part={**part, "text": ""})
            yield event(f"response.{kind}.delta", **at_part, delta=part["text"], **extra)
            yield event(f"response.{kind}.done", **at_part, text=part["text"], **extra)
            yield event("response.content_part.done", **at_part, part=part)
        yield event("response.output_item.done", output_index=i, item=item)
    done = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
    yield event(done, response=body)
