"""molt-capture: token-exact OpenAI/Anthropic-compatible capture server for agentic RL."""

from molt_capture.lazy import lazy_exports

_EXPORTS = {
    "molt_capture.errors": ["CaptureError", "ParamRejected"],
    "molt_capture.render": ["PARSERS", "ChatRenderer", "Reply", "ToolCall"],
    "molt_capture.server": ["CaptureServer"],
    "molt_capture.session": ["ChatRequest", "Generator", "Session", "SessionConfig", "TurnResult"],
    "molt_capture.types": [
        "PROMPT_VERSION",
        "Generation",
        "Rollout",
        "SamplingParams",
        "Segment",
        "TurnSpan",
    ],
}
# Loaded on first use, so importing one submodule pays for that one alone (molt_capture.lazy).
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
