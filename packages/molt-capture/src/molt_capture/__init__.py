"""molt-capture: token-exact OpenAI/Anthropic-compatible capture server for agentic RL."""

from .errors import CaptureError, ParamRejected
from .render import PARSERS, ChatRenderer, Reply, ToolCall
from .server import CaptureServer
from .session import ChatRequest, Generator, Session, SessionConfig, TurnResult
from .types import PROMPT_VERSION, Generation, Rollout, SamplingParams, Segment, TurnSpan

__all__ = [
    "PARSERS",
    "PROMPT_VERSION",
    "CaptureError",
    "CaptureServer",
    "ChatRenderer",
    "ChatRequest",
    "Generation",
    "Generator",
    "ParamRejected",
    "Reply",
    "Rollout",
    "SamplingParams",
    "Segment",
    "Session",
    "SessionConfig",
    "ToolCall",
    "TurnResult",
    "TurnSpan",
]
