"""CPU per turn of the capture session logic as a tool loop grows (no HTTP).

    python benchmarks/capture_turn_cost.py                 # 16 and 128 turns

Drives `Session.turn` directly with the deterministic fake generator and the tiny test
tokenizer: each turn echoes the reply and adds a tool result, as an agent's tool loop does.
Reported: process CPU time per turn (worker threads included) and the segment count. Earlier
turns are the recorded tokens, so only the new messages are rendered: the cost per turn should
not grow with the history.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

from transformers import PreTrainedTokenizerFast

from molt_capture import ChatRenderer, ChatRequest, Session, SessionConfig
from molt_capture.testing import ADD_TOOL, FakeGenerator, build_tiny_tokenizer, tool_call_text


async def tool_loop(renderer: ChatRenderer, turns: int) -> tuple[float, int]:
    gen = FakeGenerator(renderer.tokenizer, [tool_call_text("add", {"a": 1, "b": 2})])
    session = Session("bench", SessionConfig(max_len=10**7))
    messages = [{"role": "user", "content": "What is 1+2? " * 20}]
    start = time.process_time()
    for _ in range(turns):
        req = ChatRequest(messages=messages, tools=[ADD_TOOL])
        result = await session.turn(req, json.dumps(messages).encode(), renderer, gen, None)
        reply = result.reply.as_message()
        call_id = reply["tool_calls"][0].get("id", "call")
        messages = [*messages, reply, {"role": "tool", "content": "3", "tool_call_id": call_id}]
    return 1000 * (time.process_time() - start) / turns, len(session.segments())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, nargs="+", default=[16, 128])
    args = ap.parse_args()
    tok = PreTrainedTokenizerFast.from_pretrained(
        build_tiny_tokenizer(f"{tempfile.gettempdir()}/molt_tiny_tok")
    )
    renderer = ChatRenderer(tok, "qwen3")
    for n in args.turns:
        ms, segments = asyncio.run(tool_loop(renderer, n))
        print(f"{n:4d} turns: {ms:.2f} ms CPU per turn, {segments} segment(s)")


if __name__ == "__main__":
    main()
