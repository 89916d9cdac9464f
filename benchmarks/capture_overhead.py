"""molt-capture's cost per turn against a plain route on the same server: the same requests, the
same fake engine.

    python benchmarks/capture_overhead.py                     # 64 sessions x 8 turns, both wires
    python benchmarks/capture_overhead.py --sessions 64 --turns 16 --tools

The server runs in this process (a background thread, as the agent runner embeds it) with the
deterministic fake generator; the clients run in a child process (httpx, non-streaming multi-turn
conversations that echo each reply back), so client work does not share the server's interpreter
lock. Each of `--sessions` concurrent sessions plays `--turns` turns of one conversation, twice:

- capture: the capture server's own routes (parse, render the template, the token delta, the
  engine call, parse the reply, JSON);
- plain, the baseline: a route added to the same server that reads the same request body, calls
  the same fake engine with a fixed prompt and answers the reply's text in the wire's shape:
  HTTP, JSON and the engine call, none of capture's work.

Reported per wire and route: added latency (per request, the server's handling time, request in
to response out, minus the time inside the generator call); the round trip the client saw;
turns/s over the run's wall time; server CPU ms per turn (this process's CPU time while the
clients run, divided by turns: one core carries about 1000 / that many turns/s); and capture's
round trip p50 and server CPU per turn over the plain route's (the CPU ratio is the steadier on a
busy machine).
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time

PLAIN_PROMPT = list(range(32))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def client_main(spec: dict) -> None:
    """Child process: drive every session's conversation concurrently; print timings."""
    import httpx

    openai = spec["wire"] == "openai"

    async def episode(client: httpx.AsyncClient, base: str, rtts: list[float]) -> None:
        url = f"{base}/chat/completions" if openai else f"{base}/v1/messages"
        messages = [{"role": "user", "content": "What is 1+2?"}]
        for i in range(spec["turns"]):
            body: dict = {"model": "m", "messages": messages, "max_tokens": 64}
            if spec["tools"]:
                body["tools"] = spec["tools"]
            start = time.perf_counter()
            r = await client.post(url, json=body)
            rtts.append(time.perf_counter() - start)
            r.raise_for_status()
            reply = r.json()
            if openai:
                assistant = reply["choices"][0]["message"]
            else:
                assistant = {"role": "assistant", "content": reply["content"]}
            messages = [*messages, assistant, {"role": "user", "content": f"And step {i}?"}]

    async def run() -> dict:
        rtts: list[float] = []
        limits = httpx.Limits(max_connections=len(spec["urls"]))
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:
            start = time.perf_counter()
            await asyncio.gather(*(episode(client, u, rtts) for u in spec["urls"]))
            wall = time.perf_counter() - start
        return {"rtts": rtts, "wall": wall, "cpu": time.process_time()}

    print(json.dumps(asyncio.run(run())))


def tool_schemas(wire: str) -> list[dict]:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    if wire == "anthropic":
        return [{"name": "add", "description": "Add.", "input_schema": schema}]
    function = {"name": "add", "description": "Add.", "parameters": schema}
    return [{"type": "function", "function": function}]


def bench(args, wire: str) -> list[dict]:
    """Both routes on one server, capture first: one row each."""
    from fastapi import Request
    from transformers import PreTrainedTokenizerFast

    from molt_capture import CaptureServer
    from molt_capture.testing import FakeGenerator
    from molt_capture.tiny_tokenizer import build_tiny_tokenizer
    from molt_capture.types import SamplingParams

    tok = PreTrainedTokenizerFast.from_pretrained(
        build_tiny_tokenizer(f"{tempfile.gettempdir()}/molt_tiny_tok")
    )
    reply = "Sure. The answer to that question is 3, and here is a short explanation of why."
    fake = FakeGenerator(tok, [reply], noncanonical=False)
    gen_time: dict[str, float] = {}

    async def generator(ids, params, sid):
        start = time.perf_counter()
        if args.delay_ms:
            await asyncio.sleep(args.delay_ms / 1000)
        out = await fake(ids, params, sid)
        gen_time[sid] = time.perf_counter() - start  # turns of one session never overlap
        return out

    server = CaptureServer(tok, generator, generator_timeout_s=60)
    added: list[float] = []

    @server.app.middleware("http")
    async def timing(request: Request, call_next):
        start = time.perf_counter()
        response = await call_next(request)
        sid = request.url.path.split("/")[2]  # /s/<id>/... and /plain/<id>/...
        added.append(time.perf_counter() - start - gen_time.pop(sid, 0.0))
        return response

    async def plain(session_id: str, request: Request) -> dict:
        body = json.loads(await request.body())
        params = SamplingParams(max_tokens=body["max_tokens"])
        generation = await generator(PLAIN_PROMPT, params, session_id)
        text = tok.decode(generation.token_ids, skip_special_tokens=True)
        if request.url.path.endswith("/messages"):
            return {"role": "assistant", "content": [{"type": "text", "text": text}]}
        return {"choices": [{"message": {"role": "assistant", "content": text}}]}

    for path in ("/chat/completions", "/v1/messages"):
        server.app.add_api_route("/plain/{session_id}" + path, plain, methods=["POST"])
    server.start()
    rows = []
    for route in ("capture", "plain"):
        sessions = [server.open_session(max_len=8192) for _ in range(args.sessions)]
        if route == "capture":
            urls = [server.base_url(s.id) for s in sessions]
        else:
            urls = [f"{server.url}/plain/{s.id}" for s in sessions]
        spec = {"urls": urls, "turns": args.turns, "wire": wire}
        spec["tools"] = tool_schemas(wire) if args.tools else None
        added.clear()
        cpu = time.process_time()
        command = [sys.executable, __file__, "--client", json.dumps(spec)]
        out = subprocess.run(command, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"the {route} clients failed:\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout)
        server_cpu = time.process_time() - cpu
        segments = [server.close_session(s.id) for s in sessions]
        if route == "capture":
            whole = all(len(segs) == 1 and len(segs[0].turns) == args.turns for segs in segments)
            assert whole, "a conversation was split into several segments"
        turns = len(result["rtts"])
        rows.append(
            {
                "wire": wire,
                "route": route,
                "added_p50_ms": statistics.median(added) * 1e3,
                "added_p99_ms": pct(added, 0.99) * 1e3,
                "rtt_p50_ms": statistics.median(result["rtts"]) * 1e3,
                "rtt_p99_ms": pct(result["rtts"], 0.99) * 1e3,
                "turns_per_s": turns / result["wall"],
                "server_cpu_ms_per_turn": server_cpu / turns * 1e3,
                "client_cpu_ms_per_turn": result["cpu"] / turns * 1e3,
            }
        )
    server.stop()
    return rows


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--client":
        client_main(json.loads(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--delay-ms", type=float, default=0.0, help="fake engine latency per turn")
    p.add_argument("--tools", action="store_true", help="send a tool schema every turn")
    p.add_argument("--wire", choices=["openai", "anthropic", "both"], default="both")
    args = p.parse_args()
    wires = ["openai", "anthropic"] if args.wire == "both" else [args.wire]
    rows = [row for wire in wires for row in bench(args, wire)]
    setting = f"{args.sessions}x{args.turns}, engine {args.delay_ms:g} ms"
    setting += ", tools" if args.tools else ""
    print(
        "| sessions x turns, engine latency | wire | route | added p50 ms | added p99 ms "
        "| round trip p50 ms | round trip p99 ms | turns/s | server CPU ms/turn "
        "| client CPU ms/turn |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {setting} | {r['wire']} | {r['route']} | {r['added_p50_ms']:.2f} "
            f"| {r['added_p99_ms']:.2f} | {r['rtt_p50_ms']:.1f} | {r['rtt_p99_ms']:.1f} "
            f"| {r['turns_per_s']:.0f} | {r['server_cpu_ms_per_turn']:.2f} "
            f"| {r['client_cpu_ms_per_turn']:.2f} |"
        )
    for capture, plain in zip(rows[::2], rows[1::2], strict=True):
        rtt = capture["rtt_p50_ms"] / plain["rtt_p50_ms"]
        cpu = capture["server_cpu_ms_per_turn"] / plain["server_cpu_ms_per_turn"]
        print(f"{capture['wire']}: capture/plain round trip p50 {rtt:.2f}, server CPU {cpu:.2f}")


if __name__ == "__main__":
    main()
