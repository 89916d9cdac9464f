"""A small request's latency on the capture server while a large one is parsed and rendered.

    python benchmarks/capture_large_request.py               # a 10 MB request, 40 small ones
    python benchmarks/capture_large_request.py --mb 10 --small 40
    python benchmarks/capture_large_request.py --messages    # 10 MB as ~100-byte messages
    python benchmarks/capture_large_request.py --mb 2 --large 8   # 8 at once, on 8 sessions

The server runs in this process (a background thread, as the agent runner embeds it), with the
deterministic fake generator and the tiny test tokenizer (about 1 token per byte here, so the
large prompt takes seconds to tokenize: a harsh case). The client runs in a child process: it
times `--small` one-turn chat requests (each its own session) back to back, first alone, then
while one `--mb` MB request is in flight on another connection, counting only the small
requests that finished before the large one did. Added latency = p50 (and max) while the large
request is in flight minus p50 alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time


def client_main(spec: dict) -> None:
    import httpx

    def small(url: str) -> float:
        body = {"model": "m", "messages": [{"role": "user", "content": "What is 1+2?"}]}
        t0 = time.perf_counter()
        httpx.post(f"{url}/chat/completions", json=body, timeout=120).raise_for_status()
        return time.perf_counter() - t0

    urls = spec["small_urls"]
    half = len(urls) // 2
    alone = [small(u) for u in urls[:half]]
    size = spec["mb"] * 2**20
    if spec["messages"]:  # many small messages: parsing and validation dominate
        turn = [{"role": "user", "content": "word " * 12}, {"role": "assistant", "content": "ok"}]
        messages = turn * (size // 110 // 2) + turn[:1]
    else:  # one huge message: tokenizing dominates
        messages = [{"role": "user", "content": "word " * (size // 5)}]
    big = json.dumps({"model": "m", "messages": messages}).encode()
    done: dict[str, float] = {}

    def send_big(url: str) -> None:
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/chat/completions", content=big, timeout=600)
        done.setdefault("at", time.perf_counter())  # the first to finish ends the window
        done["status"], done["s"] = r.status_code, max(done.get("s", 0), time.perf_counter() - t0)

    threads = [threading.Thread(target=send_big, args=(u,)) for u in spec["big_urls"]]
    for thread in threads:
        thread.start()
    time.sleep(0.01)  # let the large bodies go first; their parsing starts at once
    during, slowest = [], 0.0
    for u in urls[half:]:
        t = small(u)
        slowest = max(slowest, t)
        if "at" not in done:
            during.append(t)
    for thread in threads:
        thread.join()
    print(json.dumps({"alone": alone, "during": during, "slowest": slowest, "big": done}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=10)
    ap.add_argument("--small", type=int, default=40)
    ap.add_argument("--messages", action="store_true", help="the large body as many messages")
    ap.add_argument("--large", type=int, default=1, help="large requests at once")
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        client_main(json.loads(args.client))
        return

    from transformers import PreTrainedTokenizerFast

    from molt_capture import CaptureServer
    from molt_capture.testing import FakeGenerator, build_tiny_tokenizer

    tok = PreTrainedTokenizerFast.from_pretrained(
        build_tiny_tokenizer(f"{tempfile.gettempdir()}/molt_tiny_tok")
    )
    with CaptureServer(tok, FakeGenerator(tok, ["Hi."])) as server:
        spec = {
            "mb": args.mb,
            "messages": args.messages,
            "big_urls": [server.open_session().base_url for _ in range(args.large)],
            "small_urls": [server.open_session().base_url for _ in range(2 * args.small)],
        }
        out = subprocess.run(
            [sys.executable, __file__, "--client", json.dumps(spec)],
            check=True,
            capture_output=True,
            text=True,
        )
    r = json.loads(out.stdout)
    alone, during = [1000 * x for x in r["alone"]], [1000 * x for x in r["during"]]
    base = statistics.median(alone)
    shape = "~100-byte messages" if args.messages else "one message"
    print(
        f"large requests: {args.large} x {args.mb} MB as {shape}, status {r['big']['status']}, "
        f"slowest {r['big']['s']:.1f} s"
    )
    print(f"small alone:  p50 {base:.1f} ms  max {max(alone):.1f} ms  (n={len(alone)})")
    print(f"slowest small request of the second phase: {1000 * r['slowest']:.0f} ms")
    if not during:
        print("no small request finished while the large one was in flight")
        return
    p50 = statistics.median(during)
    print(f"small during: p50 {p50:.1f} ms  max {max(during):.1f} ms  (n={len(during)})")
    print(f"added: p50 {p50 - base:.1f} ms  max {max(during) - base:.1f} ms")


if __name__ == "__main__":
    main()
