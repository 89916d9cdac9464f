"""What every wire shares: strict request models, field-named 400s, template form, SSE framing."""

from __future__ import annotations

import json
import secrets
from typing import Any, ClassVar

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import CaptureError
from .media import IMAGES_REFUSED
from .render import ToolCall
from .session import ChatRequest

# Content part / block types that carry media, on any wire.
MEDIA_TYPES = {"image_url", "input_audio", "file", "image", "document", "input_image", "input_file"}
UNTRACEABLE = "not supported: it changes what is sampled untraceably"
# Request fields (dotted) refused unless they hold a no-op value: field -> (no-ops, why). These,
# on every wire, are those some client may send (vLLM extras through `extra_body` included) that
# change what is sampled in a way the recorded log-probs would not reflect.
SAMPLING_REFUSED: dict[str, tuple[tuple, str]] = {
    "presence_penalty": ((0,), UNTRACEABLE),
    "frequency_penalty": ((0,), UNTRACEABLE),
    "repetition_penalty": ((1,), UNTRACEABLE),
    "logit_bias": (({},), UNTRACEABLE),
    "top_k": ((-1, 0), UNTRACEABLE),
    "min_p": ((0,), UNTRACEABLE),
}
STRUCTURED_OUTPUT_REFUSED = "structured output is not supported (no constrained decoding)"
UNSERVED = "not supported by this server"


def refuse(where: str, why: str) -> CaptureError:
    return CaptureError(400, f"{where}: {why}", where)


class WireModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class WireRequest(WireModel):
    # Each top-level field the wire's SDK sends is served (a field of the model), ignored on
    # purpose (harmless to the trace) or refused, so none is dropped unnoticed: each wire's
    # classification is checked against the installed SDK's request type (test_sdk_fields.py).
    IGNORED: ClassVar[frozenset[str]] = frozenset()
    REFUSED: ClassVar[dict[str, tuple[tuple, str]]] = SAMPLING_REFUSED
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, raw: Any) -> Any:
        for path, (no_ops, why) in cls.REFUSED.items():
            value = raw
            for key in path.split("."):
                value = value.get(key) if isinstance(value, dict) else None
            # A no-op compares equal and is a bool only where the no-op is (True is not 1).
            same = (value == v and isinstance(value, bool) == isinstance(v, bool) for v in no_ops)
            if value is not None and not any(same):
                raise refuse(path, why)
        return raw

    def chat(self, messages, tools, choice, max_tokens, stop, names) -> ChatRequest:
        """The turn in template form; `names`: the wire's names of `SamplingParams` fields."""
        choice = str(choice.get("type")) if isinstance(choice, dict) else choice
        if choice not in (None, "auto", "none"):
            raise refuse("tool_choice", "must be 'auto' or 'none' (no constrained decoding)")
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        sampling = (self.temperature, self.top_p, max_tokens, stop)
        return ChatRequest(messages, tools or None, *sampling, choice != "none", names)


class FunctionDef(WireModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def template(self, where: str) -> dict[str, Any]:
        """The tool in template form. Its schema must be strict JSON (1e400 parses as
        infinity): it reaches the prompt, and the Responses wire echoes it."""
        try:
            json.dumps(self.parameters, allow_nan=False)
        except ValueError:
            raise refuse(where, "a number is not finite") from None
        return {"type": "function", "function": self.model_dump(exclude_none=True)}


class TextPart(WireModel):
    text: str


class ImagePart(WireModel):
    def url(self) -> str:
        raise NotImplementedError  # a data URL or a local file (media.load_image)


def content(parts: str | list | None, where: str, images: bool) -> str | list[dict[str, Any]]:
    """Text parts joined; with an image among them (a 400 unless the model takes `images`), the
    parts in template form, the template writing each image's token where its part is."""
    if not isinstance(parts, list):
        return parts or ""
    kept = [p for p in parts if isinstance(p, TextPart | ImagePart)]
    for j, part in enumerate(parts):
        if isinstance(part, ImagePart) and not images:
            raise refuse(f"{where}.{j}", IMAGES_REFUSED)
    if not any(isinstance(p, ImagePart) for p in kept):
        return "".join(p.text for p in kept)
    return [
        {"type": "image", "image": p.url()}
        if isinstance(p, ImagePart)
        else {"type": "text", "text": p.text}
        for p in kept
    ]


def validation_error(e: ValidationError, prefix: str = "") -> CaptureError:
    """400 naming the first offending field in dotted form (`messages.0.role`); a media part the
    wire does not take gets the multimodal message instead of a type error about it."""

    def where(loc: tuple) -> str:
        parts = [str(p) for p in loc if "[" not in str(p)]  # drop union-branch names
        return ".".join([prefix, *parts] if prefix else parts) or "body"

    errors = e.errors()
    for err in errors:
        tag = (err.get("ctx") or {}).get("tag") if err["type"] == "union_tag_invalid" else None
        if err["type"] == "literal_error" and err["loc"][-1:] == ("type",):
            tag, err = err["input"], {**err, "loc": err["loc"][:-1]}
        in_content = "content" in err["loc"] or "output" in err["loc"]  # a tool's output too
        if in_content and isinstance(tag, str) and tag in MEDIA_TYPES:
            return refuse(where(err["loc"]), IMAGES_REFUSED)
    at = where(errors[0]["loc"])
    return CaptureError(400, f"invalid request field '{at}': {errors[0]['msg']}", at)


def parse(model: type[WireModel], raw: bytes | dict, prefix: str = "") -> Any:
    """Validate a body (bytes) or an item of one (dict). Bodies are strict JSON: NaN and
    Infinity literals, which no reply could carry back, are malformed JSON here."""
    if isinstance(raw, bytes | bytearray):
        try:
            raw = pydantic_core.from_json(raw, allow_inf_nan=False)
        except ValueError as e:
            raise CaptureError(400, f"invalid JSON body: {e}", "body") from None
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise validation_error(e, prefix) from None


def arguments(text: str, where: str) -> dict[str, Any]:
    """Tool-call arguments sent as a JSON string: an object, nested no deeper than a request
    body may be (the parser's recursion limit), else 400."""
    try:
        args = pydantic_core.from_json(text, allow_inf_nan=False)
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise CaptureError(400, f"{where} must be a JSON object string", where)
    return args


def check_tool_results(messages: list[dict[str, Any]], where: list[str]) -> None:
    """Every tool result answers a call of the assistant message before it (as the real APIs
    require): 400 naming the result's field (`where[i]`) otherwise."""
    calls: set | None = None
    for msg, param in zip(messages, where, strict=True):
        if msg["role"] == "assistant":
            calls = {c.get("id") for c in msg.get("tool_calls") or []} or None
        elif msg["role"] != "tool":
            calls = None
        elif calls is None:
            raise refuse(param, "a tool result must follow an assistant tool call")
        elif msg.get("tool_call_id") not in calls:
            called = f"no tool call with id {msg.get('tool_call_id')!r}"
            raise refuse(param, f"{called} in the preceding assistant message")


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def function_call(call: ToolCall) -> dict[str, str]:
    """A reply's tool call as both OpenAI wires send it: the arguments as a JSON string."""
    return {"name": call.name, "arguments": json.dumps(call.arguments)}


def sse(data: dict[str, Any], named: bool = True) -> str:
    """One server-sent event. The generator answers whole turns: a reply's events all go at once."""
    head = f"event: {data['type']}\n" if named else ""
    return f"{head}data: {json.dumps(data)}\n\n"
