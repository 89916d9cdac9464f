"""Test fakes other packages' tests reuse (never imported by production code).

`FakeGenerator` answers scripted text as token ids with per-token log-probs and weight versions
that are all distinct, so any misalignment shows up as a wrong number; the tiny tokenizer it is
used with is `molt_capture.tiny_tokenizer`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .types import PROMPT_VERSION, Generation, SamplingParams, Segment


def encode_noncanonical(tokenizer, text: str) -> list[int]:
    """Token ids for `text` that a tokenizer would never produce: plain text one character at a
    time, markup tokens whole. If the server re-tokenised generated text, ids would change."""
    added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
    ids: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, added)) + ")", text):
        if piece in added:
            ids.append(tokenizer.convert_tokens_to_ids(piece))
        else:
            for ch in piece:
                ids += tokenizer.encode(ch, add_special_tokens=False)
    return ids


@dataclass
class FakeCall:
    token_ids: list[int]
    params: SamplingParams
    session_id: str
    generation: Generation | None = None


class RecordingGenerator:
    """A real generator (the runners' token client, say) that records each call as a FakeCall
    for `assert_token_exact`. `make` builds it at the first call, inside the event loop that
    uses it (an aiohttp client belongs to one loop); `generator` is it from then on."""

    def __init__(self, make: Callable[[], Callable]):
        self.make, self.generator, self.calls = make, None, []

    async def __call__(self, token_ids, params, session_id, images=()) -> Generation:
        if self.generator is None:
            self.generator = self.make()
        call = FakeCall(list(token_ids), params, session_id)
        call.generation = await self.generator(token_ids, params, session_id, images)
        self.calls.append(call)
        return call.generation

    def calls_for(self, session_id: str) -> list[FakeCall]:
        return [c for c in self.calls if c.session_id == session_id]


class FakeGenerator:
    """Deterministic stand-in for the engine: answers scripted replies as token ids.

    `replies` cycles through texts (or is a function of the prompt ids and params). Each reply
    ends with `end_token` like a chat model's end of turn. Every emitted token gets a distinct
    log-prob and weight version. Set `fail_next` to raise on the next call (before answering)
    and `delay_s` to simulate engine latency; `hold_until_concurrent(n)` tests concurrency.
    """

    def __init__(
        self,
        tokenizer,
        replies: Iterable[str] | Callable[[list[int], SamplingParams], str] = ("Hello!",),
        end_token: str = "<|im_end|>",
        delay_s: float = 0.0,
        routing: bool = False,
        noncanonical: bool = True,
    ):
        self.tokenizer = tokenizer
        self.set_replies(replies)
        self.end_id = tokenizer.convert_tokens_to_ids(end_token)
        self.delay_s = delay_s
        self.routing = routing
        self.noncanonical = noncanonical
        self.calls: list[FakeCall] = []
        self.fail_next: BaseException | None = None
        self.gate, self.in_flight, self.peak = 0, 0, 0  # peak: the most calls in flight at once
        self._counter = 0

    def hold_until_concurrent(self, n: int) -> None:
        """From now on, hold every call until `n` have been in flight at once: calls made one
        after another time out (60 s) instead, however fast or slow the machine. Setting
        `gate = 0` releases the calls held."""
        self.gate, self.peak = n, self.in_flight

    async def _wait_for_gate(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.peak < self.gate:  # calls run one after another never get here
            if time.monotonic() > deadline:
                raise TimeoutError(f"at most {self.peak} of {self.gate} calls were in flight")
            await asyncio.sleep(0.01)

    def calls_for(self, session_id: str) -> list[FakeCall]:
        return [c for c in self.calls if c.session_id == session_id]

    def set_replies(
        self, replies: Iterable[str] | Callable[[list[int], SamplingParams], str]
    ) -> None:
        self._script = replies if callable(replies) else itertools.cycle(list(replies))

    def _next_text(self, token_ids: list[int], params: SamplingParams) -> str:
        if callable(self._script):
            return self._script(token_ids, params)
        return next(self._script)

    async def __call__(
        self, token_ids: list[int], params: SamplingParams, session_id: str
    ) -> Generation:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await self._wait_for_gate()
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        call = FakeCall(list(token_ids), params, session_id)
        self.calls.append(call)
        text = self._next_text(token_ids, params)
        encode = encode_noncanonical if self.noncanonical else _encode_plain
        ids = encode(self.tokenizer, text) + [self.end_id]
        finish, stop_reason = "stop", None
        # Like vLLM: the token completing a stop string is kept, the text after it is not.
        for i in range(len(ids)) if params.stop else ():
            decoded = self.tokenizer.decode(ids[: i + 1])
            hit = next((s for s in params.stop if s in decoded), None)
            if hit is not None:
                ids, stop_reason = ids[: i + 1], hit
                break
        if len(ids) > params.max_tokens:
            ids, finish, stop_reason = ids[: params.max_tokens], "length", None
        first = self._counter
        self._counter += len(ids)
        counters = range(first + 1, first + 1 + len(ids))
        call.generation = Generation(
            token_ids=ids,
            logprobs=[-c / 1024 for c in counters],
            finish_reason=finish,
            weight_versions=list(counters),
            routed_experts=[
                routing_row(p) for p in range(params.routing_start, len(token_ids) + len(ids) - 1)
            ]
            if self.routing
            else None,
            routing_start=params.routing_start,
            stop_reason=stop_reason,
        )
        return call.generation


def routing_row(position: int) -> list[list[int]]:
    """The fake engine's routed experts at a sequence position: one layer, top-2 of 8."""
    return [[position % 8, (position + 3) % 8]]


def _encode_plain(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# A tool to offer in tests, in each wire's form.
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


def tool_call_text(name: str, arguments: dict, compact: bool = False) -> str:
    """The Qwen3-style markup a model writes for one tool call."""
    sep = (",", ":") if compact else None
    payload = json.dumps({"name": name, "arguments": arguments}, separators=sep)
    return f"<tool_call>\n{payload}\n</tool_call>"


def assert_token_exact(segments: list[Segment], calls: list[FakeCall]) -> None:
    """The capture invariant, checked against what a generator was asked and answered.

    Every generated turn appears in exactly one segment, in order, with its ids, log-probs and
    weight versions; the engine's prompt for that turn is exactly the segment before it; the
    trainable mask covers exactly the generated tokens.
    """
    turns = [(seg, span) for seg in segments for span in seg.turns]
    answered = [c for c in calls if c.generation is not None]
    assert len(turns) == len(answered), f"{len(turns)} recorded turns, {len(answered)} generations"
    for (seg, span), call in zip(turns, answered, strict=True):
        gen = call.generation
        assert seg.token_ids[: span.start] == call.token_ids, "engine prompt != segment prefix"
        assert seg.token_ids[span.start : span.end] == gen.token_ids, "trained ids != generated"
        assert seg.logprobs[span.start : span.end] == gen.logprobs, "log-probs misaligned"
        assert seg.weight_versions[span.start : span.end] == gen.weight_versions
    for seg in segments:
        n = len(seg.token_ids)
        assert len(seg.trainable) == len(seg.logprobs) == len(seg.weight_versions) == n
        generated = {i for span in seg.turns for i in range(span.start, span.end)}
        assert {i for i, m in enumerate(seg.trainable) if m} == generated, "mask != generated"
        for i in set(range(n)) - generated:
            assert seg.logprobs[i] == 0.0 and seg.weight_versions[i] == PROMPT_VERSION
