"""Shared fixtures: the tiny tokenizer, and one live capture server on a loopback port with a
scriptable fake generator (reset before each test)."""

from __future__ import annotations

import anthropic
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from molt_capture import CaptureServer, Session
from molt_capture.testing import FakeGenerator, build_tiny_tokenizer

USER_MSG = {"role": "user", "content": "What is 1+2?"}
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
ADD_TOOL_ANTHROPIC = {
    "name": "add",
    "description": "Add two integers.",
    "input_schema": ADD_TOOL["function"]["parameters"],
}


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    return PreTrainedTokenizerFast.from_pretrained(
        build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    )


@pytest.fixture(scope="session")
def live_server(tokenizer):
    with CaptureServer(tokenizer, FakeGenerator(tokenizer), generator_timeout_s=5) as server:
        yield server


@pytest.fixture
def server(live_server):
    gen = live_server.generator
    gen.set_replies(["Hello!"])
    gen.calls.clear()
    gen.fail_next, gen.delay_s = None, 0.0
    return live_server


@pytest.fixture
def gen(server) -> FakeGenerator:
    return server.generator


def calls_of(gen: FakeGenerator, session: Session):
    return [c for c in gen.calls if c.session_id == session.id]


def openai_client(server: CaptureServer, session: Session, **kw) -> openai.OpenAI:
    kw = {"api_key": "any", "max_retries": 0, **kw}
    return openai.OpenAI(base_url=server.base_url(session.id), **kw)


def anthropic_client(server: CaptureServer, session: Session, **kw) -> anthropic.Anthropic:
    kw = {"api_key": "any", "max_retries": 0, **kw}
    return anthropic.Anthropic(base_url=server.base_url(session.id), **kw)
