"""The token client's HTTP stack, side by side: httpx (before issue 13's lever) against aiohttp
(molt_rollout.client), on the same canned vLLM replies from a local server in another process.

    python benchmarks/token_client_http.py [--concurrency 64] [--batches 8] [--repeats 3]

Each rollout is the client's two calls (`GET /weight_info`, `POST /inference/v1/generate`);
`--concurrency` rollouts run at once, as a runner's groups do. Prints the client process's CPU
milliseconds per rollout for each stack (median over repeats, alternating) and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import time

import aiohttp
import httpx

REPLY = json.dumps({"choices": [{
    "token_ids": [5], "logprobs": {"content": [{"logprob": -1.0}]}, "finish_reason": "length",
    "weight_versions": [{"version": "default", "start": 0, "end": 1}]}]}).encode()  # fmt: skip
BODY = {"model": "tiny", "token_ids": list(range(23)), "sampling_params": {"max_tokens": 1}}


def serve(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def generate(request):
        await request.body()
        return Response(REPLY, media_type="application/json")

    async def weight_info(_request):
        return Response(b'{"weight_version": "default"}', media_type="application/json")

    app = Starlette(routes=[Route("/inference/v1/generate", generate, methods=["POST"]),
                            Route("/weight_info", weight_info)])  # fmt: skip
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


async def with_httpx(url: str, batches: int, concurrency: int) -> None:
    # What TokenClient held before: one pool, no connection limit.
    client = httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0),
                               limits=httpx.Limits(max_connections=None))  # fmt: skip

    async def rollout():
        (await client.get(url + "/weight_info")).json()
        (await client.post(url + "/inference/v1/generate", json=BODY)).json()

    for _ in range(batches):
        await asyncio.gather(*(rollout() for _ in range(concurrency)))
    await client.aclose()


async def with_aiohttp(url: str, batches: int, concurrency: int) -> None:
    # What TokenClient holds now (client.py).
    session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=300.0),
        connector=aiohttp.TCPConnector(limit=0),
    )

    async def rollout():
        async with session.get(url + "/weight_info") as reply:
            json.loads(await reply.text())
        async with session.post(url + "/inference/v1/generate", json=BODY) as reply:
            json.loads(await reply.text())

    for _ in range(batches):
        await asyncio.gather(*(rollout() for _ in range(concurrency)))
    await session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(port,), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            httpx.get(url + "/weight_info", timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.1)
    rollouts = args.batches * args.concurrency
    cpu_ms: dict[str, list[float]] = {"httpx": [], "aiohttp": []}
    try:
        for _ in range(args.repeats):
            for name, run in (("httpx", with_httpx), ("aiohttp", with_aiohttp)):
                start = time.process_time()
                asyncio.run(run(url, args.batches, args.concurrency))
                cpu_ms[name].append((time.process_time() - start) / rollouts * 1e3)
    finally:
        server.terminate()
    median = {name: statistics.median(values) for name, values in cpu_ms.items()}
    print(f"{rollouts} rollouts per repeat, {args.concurrency} at once, {args.repeats} repeats")
    for name, value in median.items():
        print(f"{name:8s} client CPU per rollout: {value:.2f} ms (runs: "
              + ", ".join(f"{v:.2f}" for v in cpu_ms[name]) + ")")  # fmt: skip
    print(f"httpx / aiohttp: {median['httpx'] / median['aiohttp']:.1f}x")


if __name__ == "__main__":
    main()
