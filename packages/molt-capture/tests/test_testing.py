"""The test support other packages reuse: the fake generator's guarantees, import isolation."""

import asyncio
import subprocess
import sys

import pytest

from molt_capture import SamplingParams
from molt_capture.testing import FakeGenerator


def _gen(fake, max_tokens=100, stop=()):
    return asyncio.run(fake([1, 2], SamplingParams(max_tokens, stop=list(stop)), "sid"))


def test_every_token_gets_a_distinct_logprob_and_version(tokenizer):
    fake = FakeGenerator(tokenizer, ["one", "two three"])
    a, b = _gen(fake), _gen(fake)
    values = a.logprobs + b.logprobs
    assert len(set(values)) == len(values) and all(v < 0 for v in values)
    versions = a.weight_versions + b.weight_versions
    assert len(set(versions)) == len(versions)
    assert a.token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.decode(b.token_ids) == "two three<|im_end|>"


def test_stop_strings_and_max_tokens(tokenizer):
    fake = FakeGenerator(tokenizer, ["alpha END beta"])
    g = _gen(fake, stop=["END"])
    assert g.finish_reason == "stop" and g.stop_reason == "END"
    assert tokenizer.decode(g.token_ids).endswith("END")  # the completing token is kept
    g = _gen(fake, max_tokens=3)
    assert g.finish_reason == "length" and len(g.token_ids) == 3


def test_scripted_function_and_failure_injection(tokenizer):
    fake = FakeGenerator(tokenizer, lambda ids, params: f"saw {len(ids)}")
    assert tokenizer.decode(_gen(fake).token_ids) == "saw 2<|im_end|>"
    fake.fail_next = ConnectionError("gone")
    with pytest.raises(ConnectionError):
        _gen(fake)
    assert len(fake.calls) == 1  # the failed call answered nothing
    _gen(fake)


def test_a_whole_turn_never_imports_torch_or_vllm(tmp_path):
    # PreTrainedTokenizerFast, not AutoTokenizer: the latter imports torch whenever it is installed.
    code = f"""
import asyncio, sys
from transformers import PreTrainedTokenizerFast
from molt_capture import CaptureServer, ChatRequest
from molt_capture.testing import FakeGenerator
from molt_capture.tiny_tokenizer import build_tiny_tokenizer
tok = PreTrainedTokenizerFast.from_pretrained(build_tiny_tokenizer({str(tmp_path)!r}))
server = CaptureServer(tok, FakeGenerator(tok, ["<think>x</think>ok"]))
session = server.open_session()
req = ChatRequest(messages=[{{"role": "user", "content": "hi"}}])
asyncio.run(session.turn(req, b"r", server.renderer, server.generator, 5))
bad = [m for m in ("torch", "vllm") if m in sys.modules]
assert not bad, bad
"""
    subprocess.run([sys.executable, "-c", code], check=True)
