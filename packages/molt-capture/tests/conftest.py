"""Shared fixtures: the tiny tokenizer, and one live capture server on a loopback port with a
scriptable fake generator (reset before each test)."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from molt_capture import CaptureServer
from molt_capture.testing import FakeGenerator
from molt_capture.tiny_tokenizer import build_tiny_tokenizer


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
