"""What each of Molt's vLLM server flags costs a plain engine, one flag at a time.

    python benchmarks/gpu_rollout.py --write /tmp/q3r          # the model and prompts
    python benchmarks/engine_flags.py --model /tmp/q3r --out $OUT

Starts vLLM's OpenAI server over and over on the same GPU: bare (the flags `gpu_rollout.py`'s
bare side passes), then bare plus each group of the flags Molt adds (`molt_rollout.config.
server_args`, the function the engines are started with, grouped by flag name, and Molt's
server environment as one more group), then all of Molt's at once, then bare again. Each
server answers the same prompts x samples, all at once, to `/v1/completions` without log-probs
(aiohttp, as the runners' client). Prints generated tokens/s per variant and its ratio to the
mean of the two bare runs; their spread is the noise floor.

H200 run5 found an engine with Molt's flags at 0.64x a bare one of the call before (27.3K
against 42.7K tokens/s; docs/benchmarks.md): this splits that in one call.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gpu_rollout import MEMORY, prompt_ids

MOLT_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # what EngineServer adds to the server's environment


def base_args(model: Path, port: int) -> list[str]:
    return ["--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype",
            "bfloat16", "--gpu-memory-utilization", MEMORY, "--max-model-len", "2048"]  # fmt: skip


def molt_groups(model: Path, port: int, backend: str) -> dict[str, list[str]]:
    """Molt's server flags that the bare server lacks, grouped by flag name."""
    from molt_rollout.config import VLLMConfig, server_args

    cfg = VLLMConfig(dtype="bfloat16", gpu_memory_utilization=float(MEMORY), max_model_len=2048)
    args = server_args(cfg, str(model), port, backend)
    base = base_args(model, port)
    groups: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        flag, j = args[i], i + 1
        while j < len(args) and not args[j].startswith("--"):
            j += 1
        pair = args[i:j]
        if not _in(pair, base):
            groups.setdefault(flag, []).extend(pair)
        i = j
    return groups


def _in(pair: list[str], args: list[str]) -> bool:
    return any(args[k : k + len(pair)] == pair for k in range(len(args)))


def serve(model: Path, extra: list[str], env: dict, out: Path, name: str, port: int,
          prompts: list[list[int]], samples: int, max_tokens: int) -> float:  # fmt: skip
    """Generated tokens/s of one server with `extra` flags and `env`."""
    import aiohttp
    import httpx

    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               *base_args(model, port), *extra]  # fmt: skip
    with (out / f"{name}.log").open("w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, **env})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the server did not start, see {out / name}.log")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)

        async def run() -> float:
            timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:

                async def one(ids: list[int]) -> int:
                    body = {"model": str(model), "prompt": ids, "max_tokens": max_tokens,
                            "temperature": 1.0, "top_p": 1.0}  # fmt: skip
                    async with http.post(url + "/v1/completions", json=body) as reply:
                        reply.raise_for_status()
                        return (await reply.json())["usage"]["completion_tokens"]

                await one(prompts[0])  # warm
                t = time.perf_counter()
                counts = await asyncio.gather(*(one(p) for p in prompts for _ in range(samples)))
                return sum(counts) / (time.perf_counter() - t)

        return asyncio.run(run())
    finally:
        server.terminate()
        server.wait(120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--backend", default="molt_ipc", help="the weight-transfer backend Molt names")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/engine_flags")))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from molt_rollout.engine import free_port

    port = free_port()
    prompts = prompt_ids(args.model)
    groups = molt_groups(args.model, port, args.backend)
    every = [a for g in groups.values() for a in g]
    variants = [("bare", [], {}), *((f"+{k}", v, {}) for k, v in groups.items()),
                ("+env", [], MOLT_ENV), ("molt (all)", every, MOLT_ENV), ("bare again", [], {})]  # fmt: skip
    rates = {}
    for name, extra, env in variants:
        slug = name.strip("+ ").replace(" ", "_").replace("(", "").replace(")", "").lstrip("-")
        rates[name] = serve(args.model, extra, env, args.out, slug, port, prompts, args.samples,
                            args.max_tokens)  # fmt: skip
        print(f"{name:32s} {rates[name]:10.0f} tokens/s  {' '.join(extra)}", flush=True)
    bare = statistics.mean([rates["bare"], rates["bare again"]])
    print(f"\nbare: {rates['bare']:.0f} and {rates['bare again']:.0f} tokens/s (the noise floor)")
    for name, rate in rates.items():
        print(f"{name:32s} {rate / bare:5.2f}x bare")
    (args.out / "engine_flags.json").write_text(json.dumps({"groups": groups, "tokens_per_s":
                                                            rates}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
