"""The only code that turns messages (HF chat-template form) into text, and generated text back
into a message: transformers' response parser, one template per parser family."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from transformers.utils.chat_parsing import ResponseParser

from .errors import CaptureError
from .media import ImageEncoder, ImagePrompt, MediaError, message_images


def _qwen(**tool_calls: Any) -> dict[str, Any]:
    """A Qwen-style response template (transformers' format), given how its family writes calls."""
    # Leading whitespace before an end marker must not open an empty content region.
    end = r"\s*(?:<\|im_end\|>|<\|endoftext\|>)"
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
            "tool_calls": {**tool_calls, "repeats": True},
            "content": {"close_pattern": end, "content": "text"},
        },
    }


_PARAMETER = r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>"
RESPONSE_TEMPLATES: dict[str, dict[str, Any]] = {
    # Hermes-style JSON in <tool_call> tags: Qwen2.5, Qwen3 (dense and MoE), QwQ, Hermes 2/3.
    "qwen3": _qwen(
        open_pattern=r"\s*<tool_call>",
        close="</tool_call>",
        content="json",
        transform={"type": "function", "function": "{content}"},
    ),
    # XML function/parameter markup inside <tool_call>: Qwen3-Coder, Qwen3.5.
    "qwen3_xml": _qwen(
        open_pattern=r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>",
        close_pattern=r"</function>\s*</tool_call>",
        content="xml-inline",
        content_args={"tag_pattern": _PARAMETER},
        transform={"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
    ),
}
PARSERS = [*RESPONSE_TEMPLATES, "tokenizer"]  # "tokenizer": the model's own response_template
# Marks where a probe reply's content sits in a render; random, so no client text can forge it.
_SENTINEL = f"MOLT{secrets.token_hex(8)}"
_REASONING_FIELDS = ("reasoning_content", "thinking")  # ours, and other response templates'


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class Reply:
    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def as_message(self) -> dict[str, Any]:
        calls = [tool_call_message(tc.name, tc.arguments, tc.id) for tc in self.tool_calls]
        return assistant_message(self.content, self.reasoning, calls)

    def matches(self, msg: dict[str, Any]) -> bool:
        """Whether a client's echo of this reply is the reply (reasoning may be dropped)."""
        calls = [
            (c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []
        ]
        return (
            msg.get("role") == "assistant"
            and (msg.get("content") or "").strip() == self.content.strip()
            and calls == [(tc.name, tc.arguments) for tc in self.tool_calls]
        )


def assistant_message(content: Any, reasoning: str | None, calls: list[dict]) -> dict[str, Any]:
    """An assistant message in template form, reasoning and tool calls only when there are some."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg


def tool_call_message(name: str, arguments: dict[str, Any], call_id: str | None) -> dict[str, Any]:
    """A tool call in template form, with the id templates may render and results answer."""
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return {"id": call_id, **call} if call_id is not None else call


def _tool_call(raw: Any) -> ToolCall | None:
    """A parsed call the wires can send, else None: a name, and arguments a JSON object strict JSON
    can carry (Python's parser accepts NaN, which would make the reply invalid JSON)."""
    fn = raw.get("function") if isinstance(raw, dict) else None
    fn = fn if isinstance(fn, dict) else {}
    args = fn.get("arguments")
    try:
        args = json.loads(args) if isinstance(args, str) else args
        json.dumps(args, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return None
    if not isinstance(fn.get("name"), str) or not isinstance(args, dict):
        return None
    return ToolCall(f"call_{secrets.token_hex(12)}", fn["name"], args)


class ChatRenderer:
    def __init__(self, tokenizer, parser: str = "qwen3", chat_template_kwargs: dict | None = None):
        template = RESPONSE_TEMPLATES.get(parser)
        if parser == "tokenizer":
            template = getattr(tokenizer, "response_template", None)
            if template is None:
                raise ValueError("parser='tokenizer' but the tokenizer has no response_template")
        elif template is None:
            raise ValueError(f"unknown parser {parser!r}; choose one of {PARSERS}")
        self.tokenizer = tokenizer
        self.response_template = template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.closing_ids = self._closing_ids()
        # A multimodal model's processor (set by the capture server); None: text only.
        self.images: ImageEncoder | None = None

    def render(
        self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool
    ) -> str:
        options = {**self.chat_template_kwargs, "tokenize": False}
        options["add_generation_prompt"] = add_generation_prompt
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, **options)
        except Exception as e:  # jinja raises many types; a bad conversation is the client's
            why = f"the chat template rejected the messages: {e}"
            raise CaptureError(400, why, "messages") from e

    def render_delta(
        self, reply: dict[str, Any], messages: list[dict], tools: list[dict] | None
    ) -> tuple[str, str] | None:
        """The template's text for `messages` after `reply`, and the render it ends, rendered after
        a stand-in history; None when the reply's end renders differently once messages follow."""
        probe = {**reply, "content": _SENTINEL}
        base = [{"role": "user", "content": "x"}, probe]
        try:
            before = self.render(base, tools, add_generation_prompt=False)
            after = self.render([*base, *messages], tools, add_generation_prompt=True)
        except CaptureError:
            return None
        _, found, end = before.partition(_SENTINEL)  # end: tool calls, closing
        _, found_after, tail = after.partition(_SENTINEL)
        if not (found and found_after and tail.startswith(end)):
            return None
        return tail[len(end) :], after

    def encode(self, text: str) -> list[int]:
        # The batch call releases the GIL (plain encode holds it), so a large prompt being
        # tokenized on a worker thread does not stall the event loop.
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        return backend.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_messages(self, text: str, messages: list[dict], where: str) -> ImagePrompt:
        try:
            sources = [] if self.images is None else message_images(messages, where=where)
            if sources:
                return self.images.encode(text, sources, where)
        except MediaError as e:
            raise CaptureError(400, str(e), where) from e
        return ImagePrompt(self.encode(text))

    def _closing_ids(self) -> list[int]:
        """The template's tokens after an assistant message's content (Qwen: `<|im_end|>\\n`)."""
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        return self.encode(self.render(probe, None, False).partition(_SENTINEL)[2])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def missing_closing(self, generated: list[int]) -> list[int]:
        """The closing tokens the engine stopped before: if it emitted `<|im_end|>` itself,
        only the separator after it is missing."""
        close = self.closing_ids
        for k in range(len(close), 0, -1):
            if generated[-k:] == close[:k]:
                return close[k:]
        return list(close)

    def parse(
        self,
        generated: list[int],
        prompt_text: str,
        tools: list[dict] | None,
        stop_string: str | None = None,
        parse_tools: bool = True,
    ) -> Reply:
        text = self.decode(generated)
        if stop_string and stop_string in text:  # the client never sees its stop string
            text = text[: text.index(stop_string)]
        if not parse_tools:  # tool_choice "none": the generated text is the answer, markup and all
            return Reply(content=self._strip_special(text))
        try:
            parser = ResponseParser(self.response_template, prefix=prompt_text, tools=tools)
            events = parser.initial_events + parser.feed(text)
            msg, final = parser.finalize()
            calls = [_tool_call(raw) for raw in msg.get("tool_calls") or []]
        except Exception:  # any parser failure: the output is the model's, never a server error
            calls = None
        if calls is None or None in calls:
            # Malformed markup (broken JSON in a tool call, a call without a usable name or
            # arguments) is the model's answer: it is returned as text; the trace still holds
            # exactly what was generated.
            return Reply(content=self._strip_special(text))
        # Every region's text, not the parser's last one: a stray special token or a second
        # reasoning block starts a new region, and the text before it must reach the agent too.
        closed: dict[str, list[str]] = {}
        for event in [*events, *final]:
            if event["type"] == "region_close" and isinstance(event.get("value"), str):
                closed.setdefault(event["field"], []).append(event["value"])
        content = self._join(closed.get("content", []))
        reasoning = self._join([t for f in _REASONING_FIELDS for t in closed.get(f, [])])
        return Reply(content=content, reasoning=reasoning or None, tool_calls=calls)

    def _join(self, texts: list[str]) -> str:
        return "\n\n".join(t for t in map(self._strip_special, texts) if t)

    def _strip_special(self, text: str) -> str:
        for tok in self.tokenizer.all_special_tokens:
            text = text.replace(tok, "")
        return text.strip()
