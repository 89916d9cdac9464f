"""Streaming pool vs synchronous scheduling on a simulated pipeline: no model, the real pool.

    python benchmarks/pool_simulated.py                      # the setting in docs/performance.md
    python benchmarks/pool_simulated.py --slots 16 --mean-latency-ms 50 --train-ms 200

The engine is `--slots` concurrent sequences (threads). A rollout holds one slot for a
lognormal time (mean `--mean-latency-ms`, log-space deviation `--sigma`, cut at
`--max-latency-factor` x the mean, as max_tokens cuts a response); a group is done when its n
rollouts are. Its generated tokens carry the weight version at the rollout's start and at its
end, as a partial rollout across a refit does. The trainer sleeps `--train-ms` per step, then
bumps the weight version (refit taken as instant). Both schedules drive `RolloutPool`:

- sync: `force_on_policy` (B groups launched inside next_batch, nothing generates while the
  trainer trains, every token of the trained version);
- async: streaming, K = `--max-inflight-groups` > B, `max_staleness` = `--max-staleness`,
  stale groups dropped (or requeued: `--stale-policy`); the weight version bumps every step.

Measured over the steps after the first `--warmup` (the pipeline filling up is not steady
state): step time (wall time per step), engine idle fraction (1 - time-averaged busy slots /
slots; work on groups later dropped as stale counts as busy), trainer idle fraction (time
blocked in next_batch / wall time), stale groups per step and the mean version lag of trained
tokens. The defaults are the setting in docs/performance.md: the trainer step (400 ms) equals
the engine's work per batch at full use and about the synchronous batch generation time.
"""

from __future__ import annotations

import argparse
import math
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from molt_capture.types import Generation, Rollout, Segment
from molt_rollout import GroupResult, PromptTask, RolloutConfig, RolloutPool


class InfiniteSource:
    def __init__(self):
        self.index = 0

    def next(self) -> tuple[int, dict]:
        self.index += 1
        return self.index - 1, {"prompt": f"q{self.index - 1}"}

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, d: dict) -> None:
        self.index = d["index"]


class SimEngine:
    """`slots` concurrent sequences; rollouts beyond that queue, as in a full engine."""

    def __init__(self, slots: int, mean_s: float, sigma: float, cap_factor: float, seed: int):
        self.executor = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="slot")
        self.slots = slots
        self.mu = math.log(mean_s) - sigma**2 / 2  # lognormal with this mean
        self.sigma, self.cap_s = sigma, cap_factor * mean_s
        self.rng = random.Random(seed)
        self.version = 0
        self.lock = threading.Lock()
        self.busy: list[tuple[float, float]] = []  # (start, end) of every rollout

    def launch(self, task: PromptTask) -> Future:
        group: Future = Future()
        rollouts: list[Rollout] = []

        def one_done(f: Future) -> None:
            if f.cancelled():  # close() cancels queued rollouts; their group is abandoned
                return
            with self.lock:
                rollouts.append(f.result())
                done = len(rollouts) == task.n
            if done:
                group.set_result(GroupResult(task, rollouts, []))

        for k in range(task.n):
            latency = min(self.rng.lognormvariate(self.mu, self.sigma), self.cap_s)
            self.executor.submit(self._rollout, task, k, latency).add_done_callback(one_done)
        return group

    def _rollout(self, task: PromptTask, k: int, latency: float) -> Rollout:
        start, v0 = time.perf_counter(), self.version
        time.sleep(latency)
        end, v1 = time.perf_counter(), self.version
        with self.lock:
            self.busy.append((start, end))
        seg = Segment()
        seg.append_context([1])
        seg.append_generation(Generation([2, 3], [-1.0, -1.0], "stop", [v0, v1]), max_tokens=2)
        return Rollout([seg], float(k % 2), f"{task.group_id}-{k}", task.group_id)

    def busy_seconds(self, t0: float, t1: float) -> float:
        with self.lock:
            return sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in self.busy)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


@dataclass
class Measured:
    step_s: float
    engine_idle: float
    trainer_idle: float
    batch_gen_s: float  # mean time next_batch blocked
    stale_per_step: float
    lag_mean: float


def run(args: argparse.Namespace, sync: bool) -> Measured:
    engine = SimEngine(
        args.slots, args.mean_latency_ms / 1e3, args.sigma, args.max_latency_factor, args.seed
    )
    rollout = RolloutConfig(
        groups_per_batch=args.groups_per_batch,
        n_samples_per_prompt=args.n,
        stale_policy=args.stale_policy,
    )
    pool = RolloutPool(
        InfiniteSource(),
        engine.launch,
        rollout,
        max_inflight_groups=args.groups_per_batch if sync else args.max_inflight_groups,
        max_staleness=None if sync else args.max_staleness,
        force_on_policy=sync,
    )
    pool.start()
    waits, stale, lags = [], 0.0, []
    t_begin = 0.0
    for version in range(args.warmup + args.steps):  # one optimizer step per weight version
        if version == args.warmup:
            t_begin = time.perf_counter()
        batch = pool.next_batch(version, timeout_s=60)
        if version >= args.warmup:
            waits.append(batch.metrics["pool/wait_s"])
            stale += batch.metrics["pool/stale_dropped"] + batch.metrics["pool/stale_requeued"]
            lags.append(batch.metrics["pool/version_lag_mean"])
        time.sleep(args.train_ms / 1e3)  # the optimizer step
        engine.version = version + 1  # the refit
    t_end = time.perf_counter()
    pool.close()
    engine.close()
    wall = t_end - t_begin
    return Measured(
        step_s=wall / args.steps,
        engine_idle=1 - engine.busy_seconds(t_begin, t_end) / (args.slots * wall),
        trainer_idle=sum(waits) / wall,
        batch_gen_s=sum(waits) / len(waits),
        stale_per_step=stale / args.steps,
        lag_mean=sum(lags) / len(lags),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--groups-per-batch", type=int, default=8, help="B")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-inflight-groups", type=int, default=9, help="K (async)")
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--stale-policy", default="drop", choices=["drop", "requeue"])
    p.add_argument("--slots", type=int, default=4, help="engine concurrency")
    p.add_argument("--mean-latency-ms", type=float, default=25.0)
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma (log space)")
    p.add_argument("--max-latency-factor", type=float, default=4.0, help="cut, x mean")
    p.add_argument("--train-ms", type=float, default=400.0, help="trainer step time")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    work_s = args.groups_per_batch * args.n * args.mean_latency_ms / 1e3 / args.slots
    print(
        f"B={args.groups_per_batch} n={args.n} K={args.max_inflight_groups} slots={args.slots} "
        f"latency mean {args.mean_latency_ms} ms sigma {args.sigma} cut "
        f"{args.max_latency_factor}x; train {args.train_ms} ms; engine work per batch at full "
        f"use {work_s * 1e3:.0f} ms; {args.steps} steps after {args.warmup} warm-up"
    )
    sync, streaming = run(args, sync=True), run(args, sync=False)
    print()
    print(
        "| schedule | step time (ms) | engine idle | trainer idle | next_batch wait (ms) "
        "| stale groups / step | version lag (mean) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, m in (("sync (force_on_policy)", sync), ("async (streaming)", streaming)):
        print(
            f"| {name} | {m.step_s * 1e3:.0f} | {m.engine_idle:.1%} | {m.trainer_idle:.1%} "
            f"| {m.batch_gen_s * 1e3:.0f} | {m.stale_per_step:.2f} | {m.lag_mean:.2f} |"
        )
    print(f"\nasync/sync step time: {streaming.step_s / sync.step_s:.2f}")


if __name__ == "__main__":
    main()
