"""molt-capture server overhead per turn, with the deterministic fake generator.

    python benchmarks/capture_overhead.py                          # 64 sessions x 8 turns, both wires
    python benchmarks/capture_overhead.py --sessions 64 --turns 16 --tools

The server runs in this process (a background thread, as the agent runner embeds it); the
clients run in a child process (httpx, raw HTTP, non-streaming multi-turn conversations that echo
each reply back), so client work does not share the server's interpreter lock. Each of
`--sessions` concurrent sessions plays `--turns` turns of one conversation.

- added latency: per request, the server's handling time (an HTTP middleware, request in to
  response out) minus the time spent inside the generator call. It is what capture costs on top
  of the engine: parsing, rendering the template twice, the token delta, reply parsing, JSON.
- turns/s: completed turns over the wall time of the whole run. With a zero-latency generator
  the client process and the server share the machine's cores, so the server's own ceiling is
  better read from server CPU ms/turn (process CPU time of this process, which runs only the
  server while the clients run, divided by turns): one core carries about 1000 / that many turns/s.
- round trip: what the client saw (includes HTTP and client time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def client_main(spec: dict) -> None:
    """Child process: drive every session's conversation concurrently; print timings."""
    import httpx

    async def episode(client: httpx.AsyncClient, base: str, rtts: list[float]) -> None:
        tools = spec["tools"]
        if spec["wire"] == "openai":
            url, messages = (
                f"{base}/chat/completions",
                [{"role": "user", "content": "What is 1+2?"}],
            )
        else:
            url, messages = f"{base}/v1/messages", [{"role": "user", "content": "What is 1+2?"}]
        for i in range(spec["turns"]):
            body: dict = {"model": "m", "messages": messages, "max_tokens": 64}
            if tools:
                body["tools"] = tools
            t0 = time.perf_counter()
            r = await client.post(url, json=body)
            rtts.append(time.perf_counter() - t0)
            r.raise_for_status()
            reply = r.json()
            if spec["wire"] == "openai":
                assistant = reply["choices"][0]["message"]
            else:
                assistant = {"role": "assistant", "content": reply["content"]}
            messages = [*messages, assistant, {"role": "user", "content": f"And step {i}?"}]

    async def run() -> dict:
        rtts: list[float] = []
        limits = httpx.Limits(max_connections=len(spec["urls"]))
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:
            t0 = time.perf_counter()
            await asyncio.gather(*(episode(client, u, rtts) for u in spec["urls"]))
            wall = time.perf_counter() - t0
        return {"rtts": rtts, "wall": wall, "cpu": time.process_time()}

    print(json.dumps(asyncio.run(run())))


def bench(args, wire: str) -> dict:
    from fastapi import Request
    from transformers import PreTrainedTokenizerFast

    from molt_capture import CaptureServer
    from molt_capture.testing import FakeGenerator
    from molt_capture.tiny_tokenizer import build_tiny_tokenizer

    tok = PreTrainedTokenizerFast.from_pretrained(
        build_tiny_tokenizer(f"{tempfile.gettempdir()}/molt_tiny_tok")
    )
    reply = "Sure. The answer to that question is 3, and here is a short explanation of why."
    fake = FakeGenerator(tok, [reply], noncanonical=False)
    gen_time: dict[str, float] = {}

    async def generator(ids, params, sid):
        t0 = time.perf_counter()
        if args.delay_ms:
            await asyncio.sleep(args.delay_ms / 1000)
        out = await fake(ids, params, sid)
        gen_time[sid] = time.perf_counter() - t0  # turns of one session never overlap
        return out

    server = CaptureServer(tok, generator, generator_timeout_s=60)
    added: list[float] = []

    @server.app.middleware("http")
    async def timing(request: Request, call_next):
        t0 = time.perf_counter()
        response = await call_next(request)
        sid = request.url.path.split("/")[2]
        added.append(time.perf_counter() - t0 - gen_time.pop(sid, 0.0))
        return response

    server.start()
    sessions = [server.open_session(max_len=8192) for _ in range(args.sessions)]
    tools = None
    if args.tools:
        schema = {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        }
        tools = [
            {
                "type": "function",
                "function": {"name": "add", "description": "Add.", "parameters": schema},
            }
        ]
        if wire == "anthropic":
            tools = [{"name": "add", "description": "Add.", "input_schema": schema}]
    spec = {
        "urls": [server.base_url(s.id) for s in sessions],
        "turns": args.turns,
        "wire": wire,
        "tools": tools,
    }
    cpu0 = time.process_time()
    out = subprocess.run(
        [sys.executable, __file__, "--client", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout)
    server_cpu = time.process_time() - cpu0
    segments = [server.close_session(s.id) for s in sessions]
    server.stop()
    assert all(len(segs) == 1 and len(segs[0].turns) == args.turns for segs in segments), (
        "segmented"
    )
    ms = 1000
    return {
        "wire": wire,
        "turns": len(result["rtts"]),
        "added_p50_ms": statistics.median(added) * ms,
        "added_p99_ms": pct(added, 0.99) * ms,
        "rtt_p50_ms": statistics.median(result["rtts"]) * ms,
        "rtt_p99_ms": pct(result["rtts"], 0.99) * ms,
        "turns_per_s": len(result["rtts"]) / result["wall"],
        "tokens_last_turn": len(segments[0][0]),
        "server_cpu_ms_per_turn": server_cpu / len(result["rtts"]) * ms,
        "client_cpu_ms_per_turn": result["cpu"] / len(result["rtts"]) * ms,
    }


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--client":
        client_main(json.loads(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--delay-ms", type=float, default=0.0, help="fake engine latency per turn")
    p.add_argument("--tools", action="store_true", help="send a tool schema every turn")
    p.add_argument("--wire", choices=["openai", "anthropic", "both"], default="both")
    args = p.parse_args()
    wires = ["openai", "anthropic"] if args.wire == "both" else [args.wire]
    rows = [bench(args, w) for w in wires]
    setting = f"{args.sessions}x{args.turns}, engine {args.delay_ms:g} ms" + (
        ", tools" if args.tools else ""
    )
    print(
        "| sessions x turns, engine latency | wire | added p50 ms | added p99 ms | round trip p50 ms "
        "| round trip p99 ms | turns/s | server CPU ms/turn | client CPU ms/turn |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {setting} | {r['wire']} | {r['added_p50_ms']:.2f} | {r['added_p99_ms']:.2f} | "
            f"{r['rtt_p50_ms']:.1f} | {r['rtt_p99_ms']:.1f} | {r['turns_per_s']:.0f} | "
            f"{r['server_cpu_ms_per_turn']:.2f} | {r['client_cpu_ms_per_turn']:.2f} |"
        )


if __name__ == "__main__":
    main()
