"""What every wire shares: strict request models, field-named 400s, and the refusals that must
read the same on every wire (sampling the trace cannot record, images, structured output,
forced tool choice)."""

from __future__ import annotations

import json
from typing import Any

import pydantic_core
from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import CaptureError
from .media import IMAGES_REFUSED

# Content part / block types that carry media, on any wire.
MEDIA_TYPES = {"image_url", "input_audio", "file", "image", "document", "input_image", "input_file"}
# Fields some client may send (vLLM extras through `extra_body` included) that change what is
# sampled in a way the recorded log-probs would not reflect; each with the values that are no-ops.
SAMPLING_REFUSED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "top_k": (-1, 0),
    "min_p": (0,),
}


class WireModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class SamplingExtras(WireModel):
    """Mixed into every wire's request so the refusals above read alike everywhere."""

    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    top_k: Any = None
    min_p: Any = None

    def refuse_sampling_extras(self) -> None:
        for name, no_ops in SAMPLING_REFUSED.items():
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value not in no_ops):
                raise CaptureError(
                    400, f"{name} is not supported: it changes what is sampled untraceably", name
                )


def validation_error(e: ValidationError, prefix: str = "") -> CaptureError:
    """400 naming the first offending field in dotted form (`messages.0.role`); a media part
    anywhere gets the multimodal message instead of a type error about it."""

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
            at = where(err["loc"])
            return CaptureError(400, f"{at}: {IMAGES_REFUSED}", at)
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


def tool_schema(schema: dict[str, Any] | None, where: str) -> None:
    """A tool's JSON schema must be strict JSON (1e400 parses as infinity): the schema reaches
    the prompt and the Responses wire echoes it in its reply."""
    try:
        json.dumps(schema, allow_nan=False)
    except ValueError:
        raise CaptureError(400, f"{where}: a number is not finite", where) from None


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


def refuse_tool_choice(choice: str, param: str = "tool_choice") -> None:
    if choice not in ("auto", "none"):
        raise CaptureError(
            400, f"only {param} 'auto' or 'none' is supported (no constrained decoding)", param
        )


def refuse_structured_output(param: str) -> CaptureError:
    return CaptureError(
        400, f"structured output ({param}) is not supported (no constrained decoding)", param
    )


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
            raise CaptureError(
                400, f"{param}: a tool result must follow an assistant tool call", param
            )
        elif msg.get("tool_call_id") not in calls:
            raise CaptureError(
                400,
                f"{param}: no tool call with id {msg.get('tool_call_id')!r} in the preceding "
                "assistant message",
                param,
            )
