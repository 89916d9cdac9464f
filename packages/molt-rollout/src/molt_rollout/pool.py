"""The streaming prompt-group pool: prompt groups keep generating while the trainer trains.

A group is the n rollouts of one prompt. The pool keeps up to K groups outstanding (launched and
not yet handed out), refills a slot as soon as its group comes back, and `next_batch` hands out B
complete groups as soon as B are finished. Groups the filter rejects, groups with too few
surviving rollouts and groups whose runner failed are counted and replaced by new prompts;
groups too stale for the trainer's weight version are dropped or generated again. The pool never
knows where a group runs: `launch(task)` returns a `concurrent.futures.Future`, done by a Ray
actor in production and by a thread in the tests. See docs/pool.md.

Threads: the done-callbacks run on whichever thread completed the future; one background thread
calls `launch` (never under the lock, never recursively from a callback). One Condition guards
all state.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from molt_capture.types import Rollout
from molt_rollout.agent import Dropped
from molt_rollout.config import RolloutConfig

log = logging.getLogger(__name__)

# Groups whose runner failed one after another (every outstanding slot, twice) before the pool
# stops and `next_batch` raises: a dead runner must not silently burn through the dataset.
RUNNER_ERROR_ROUNDS = 2


class PromptSource(Protocol):
    """What the pool reads prompts from (molt_rollout.data.PromptSource is the real one)."""

    def next(self) -> tuple[int, dict[str, Any]]: ...  # (prompt_index, row); StopIteration: done
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, d: dict[str, Any]) -> None: ...


@dataclass
class PromptTask:
    """What the pool asks a runner to do: n rollouts of one prompt."""

    prompt_index: int  # global, increasing in the order the data source gave the prompt
    row: dict[str, Any]  # the dataset row (JSON-able)
    group_id: str  # f"p{prompt_index}", plus f"-r{attempt}" when requeued
    n: int  # samples per prompt
    attempt: int = 0  # how often this prompt was requeued; keeps rollout ids unique
    for_eval: bool = False  # run with the eval sampling parameters (eval.py), not the training ones


@dataclass
class GroupResult:
    task: PromptTask
    rollouts: list[Rollout]  # the rollouts that finished
    dropped: list[Dropped] = field(default_factory=list)  # the ones that did not


Launch = Callable[[PromptTask], "Future[GroupResult]"]


@dataclass
class Batch:
    groups: list[GroupResult]  # sorted by prompt_index
    metrics: dict[str, float]  # pool/* and rollout/dropped/<reason>, since the previous batch
    dropped: dict[str, int]  # dropped rollouts by reason, since the previous batch


def group_id(prompt_index: int, attempt: int) -> str:
    return f"p{prompt_index}" if attempt == 0 else f"p{prompt_index}-r{attempt}"


def trainable_versions(rollout: Rollout) -> Counter[int]:
    """How many trainable tokens of the rollout each weight version sampled."""
    counts: Counter[int] = Counter()
    for seg in rollout.segments:
        counts.update(itertools.compress(seg.weight_versions, seg.trainable))
    return counts


@dataclass
class _Finished:
    """A group waiting for a batch, with its token versions counted off the trainer's path."""

    result: GroupResult
    versions: list[Counter[int]]  # per rollout: trainable tokens by weight version

    @property
    def oldest(self) -> int | None:
        return min((v for c in self.versions for v in c), default=None)


class RolloutPool:
    def __init__(
        self,
        source: PromptSource,
        launch: Launch,
        rollout: RolloutConfig,
        *,
        max_inflight_groups: int,
        max_staleness: int | None = None,
        force_on_policy: bool = False,
        min_rollouts_per_group: int = 1,
        group_filter: Callable[[GroupResult], bool] | None = None,
    ):
        """B and n and the stale policy come from `rollout`; K = `max_inflight_groups` >= B
        groups stay outstanding; `max_staleness` is the lag in weight versions a trained token
        may have (None: unbounded); `force_on_policy` launches only inside `next_batch`; a
        group with fewer than `min_rollouts_per_group` survivors is dropped and backfilled."""
        self.source, self.launch = source, launch
        self.batch_size, self.n = rollout.groups_per_batch, rollout.n_samples_per_prompt
        self.stale_policy = rollout.stale_policy
        self.max_inflight, self.max_staleness = max_inflight_groups, max_staleness
        self.force_on_policy, self.min_rollouts = force_on_policy, min_rollouts_per_group
        self.group_filter = group_filter
        self._cond = threading.Condition()  # guards every attribute below
        self._queue: deque[tuple[int, dict[str, Any], int]] = deque()  # launched before source
        self._pending: dict[str, PromptTask] = {}  # taken for launch, not come back yet
        self._finished: list[_Finished] = []  # passed filter and size check, in finish order
        self._want = 0  # outstanding groups to keep: K, or B inside a forced next_batch
        self._source_done = False
        self._error: BaseException | None = None  # stops the pool; next_batch raises it
        self._failure: BaseException | None = None  # from outside (`fail`): raised as it is
        self._interrupt: BaseException | None = None  # from outside (`interrupt`): raised once
        self._runner_errors_in_row = 0
        self._counts: Counter[str] = Counter()  # pool/* counters since the previous batch
        self._dropped: Counter[str] = Counter()  # dropped rollouts by reason, same window
        self._started = self._closed = False
        self._thread: threading.Thread | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Launch up to K groups (none when forced on-policy: those launch in next_batch)."""
        with self._cond:
            if self._started:
                raise RuntimeError("RolloutPool.start() called twice")
            self._started = True
            self._want = 0 if self.force_on_policy else self.max_inflight
        self._thread = threading.Thread(target=self._launch_loop, name="molt-pool", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop launching; futures still pending are abandoned (their results are ignored)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)

    def fail(self, error: BaseException) -> None:
        """Stop the pool on an error from outside it (a dead engine): a waiting or later
        `next_batch` raises it at once instead of waiting for groups that cannot come."""
        with self._cond:
            self._failure = self._failure or error
            self._cond.notify_all()

    def interrupt(self, error: BaseException) -> None:
        """Wake the trainer's side (a restarted engine waits for the trainer's weights):
        `next_batch` raises `error` once, a waiting call now, else the next one. The pool
        keeps running."""
        with self._cond:
            self._interrupt = error
            self._cond.notify_all()

    def __enter__(self) -> RolloutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the trainer's side -----------------------------------------------------------------

    def next_batch(self, version: int, timeout_s: float | None = None) -> Batch:
        """Block until B finished groups pass the staleness check for `version` (the weight
        version the batch will be trained from); hand them out sorted by prompt index.

        Raises TimeoutError after `timeout_s`, StopIteration when the source ran out before B
        more groups could finish, RuntimeError when the pool stopped on an error, the error
        given to `fail` or `interrupt` as it is.
        """
        t0 = time.monotonic()
        with self._cond:
            if not self._started or self._closed:
                raise RuntimeError("next_batch() needs a started, open pool: call start() first")
            if self.force_on_policy:
                self._want = self.batch_size
                self._cond.notify_all()
            try:
                while True:
                    if self._failure is not None:
                        raise self._failure  # as given: it names its own cause
                    if self._interrupt is not None:
                        error, self._interrupt = self._interrupt, None
                        raise error
                    if self._error is not None:
                        raise RuntimeError(f"rollout pool stopped: {self._error}") from self._error
                    self._screen_stale(version)
                    if len(self._finished) >= self.batch_size:
                        break
                    if not self._pending and not self._queue and self._source_done:
                        raise StopIteration(
                            f"the prompt source ran out: {len(self._finished)} finished groups "
                            f"left, {self.batch_size} needed"
                        )
                    remaining = None if timeout_s is None else t0 + timeout_s - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(
                            f"next_batch waited {timeout_s} s: {len(self._finished)} of "
                            f"{self.batch_size} groups finished, {len(self._pending)} in "
                            f"flight, {len(self._queue)} queued"
                        )
                    self._cond.wait(remaining)
                wait_s = time.monotonic() - t0
                capacity = self.batch_size if self.force_on_policy else self._want
                occupancy = (len(self._pending) + len(self._finished)) / capacity
                taken = self._finished[: self.batch_size]
                del self._finished[: self.batch_size]
                batch = self._assemble(taken, version, wait_s, occupancy)
            finally:
                if self.force_on_policy:
                    self._want = 0  # nothing generates while the trainer trains
            self._cond.notify_all()  # the launcher refills the slots just handed out
        return batch

    # ---- exactly-once state ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The source's state plus every prompt taken from it and not yet handed out (in flight
        or finished and waiting) and the queue of prompts to generate first. JSON-able."""
        with self._cond:
            tasks = list(self._pending.values()) + [f.result.task for f in self._finished]
            return {
                "source": self.source.state_dict(),
                "outstanding": [_prompt_entry(t.prompt_index, t.row, t.attempt) for t in tasks],
                "queued": [_prompt_entry(i, row, a) for i, row, a in self._queue],
            }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """On a fresh pool, before start(): restore the source; the saved prompts go first in
        line, in prompt-index order, so every prompt is trained exactly once."""
        with self._cond:
            if self._started:
                raise RuntimeError("load_state_dict() must be called before start()")
            self.source.load_state_dict(d["source"])
            entries = sorted(d["outstanding"] + d["queued"], key=lambda e: e["prompt_index"])
            self._queue = deque((e["prompt_index"], e["row"], e["attempt"]) for e in entries)

    # ---- internals: launching (background thread) --------------------------------------------

    def _launch_loop(self) -> None:
        while True:
            with self._cond:
                task = None
                while task is None:
                    if self._closed:
                        return
                    outstanding = len(self._pending) + len(self._finished)
                    stopped = self._error is not None or self._failure is not None
                    if not stopped and outstanding < self._want:
                        task = self._take_task()  # None when there is no prompt left
                    if task is None:
                        self._cond.wait()
            try:
                future = self.launch(task)
            except Exception as e:  # the launcher itself failed: same as a failed group
                future = Future()
                future.set_exception(e)
            future.add_done_callback(lambda f, task=task: self._on_done(task, f))

    def _take_task(self) -> PromptTask | None:
        """The next prompt (queued ones first), registered as pending. Under the lock, so the
        source's state and the pending set always agree."""
        if self._queue:
            index, row, attempt = self._queue.popleft()
        elif self._source_done:
            return None
        else:
            try:
                index, row = self.source.next()
            except StopIteration:
                self._source_done = True
                self._cond.notify_all()  # a waiting next_batch may now know it cannot finish
                return None
            except Exception as e:
                self._error = e
                self._cond.notify_all()
                return None
            attempt = 0
        n = self.n
        task = PromptTask(index, row, group_id(index, attempt), n, attempt)
        self._pending[task.group_id] = task
        return task

    # ---- internals: a group comes back (any thread) -----------------------------------------

    def _on_done(self, task: PromptTask, future: Future) -> None:
        result, error, verdict, versions = None, None, "runner_error", []
        try:
            result = future.result()
        except BaseException as e:  # includes CancelledError: the actor died, the call failed
            error = e
        if result is not None:
            try:  # judged outside the lock: the filter is user code and may be slow
                verdict, versions = self._judge(result)
            except Exception as e:  # the filter raised, or the result is malformed: a bug
                verdict, error = "fatal", e
        with self._cond:
            if self._closed or self._pending.pop(task.group_id, None) is None:
                return  # abandoned by close()
            self._record(task, result, verdict, versions, error)
            self._cond.notify_all()

    def _judge(self, result: GroupResult) -> tuple[str, list[Counter[int]]]:
        if len(result.rollouts) < self.min_rollouts:
            return "group_too_small", []
        if self.group_filter is not None and not self.group_filter(result):
            return "filtered", []
        return "kept", [trainable_versions(r) for r in result.rollouts]

    def _record(
        self,
        task: PromptTask,
        result: GroupResult | None,
        verdict: str,
        versions: list[Counter[int]],
        error: BaseException | None,
    ) -> None:
        if verdict == "fatal":
            self._error = error
            return
        if verdict == "runner_error":
            log.warning("group %s failed in its runner: %r", task.group_id, error)
            self._dropped["runner_error"] += task.n
            self._counts["groups_dropped"] += 1
            self._runner_errors_in_row += 1
            limit = RUNNER_ERROR_ROUNDS * max(self._want, self.batch_size)
            if self._runner_errors_in_row >= limit:
                self._error = RuntimeError(
                    f"{self._runner_errors_in_row} groups in a row failed in their runners; "
                    f"the last: {error!r}"
                )
            return
        self._runner_errors_in_row = 0
        self._counts["groups_finished"] += 1
        for d in result.dropped:
            log.warning("rollout %s dropped (%s): %s", d.rollout_id, d.reason, d.detail)
            self._dropped[d.reason] += 1
        if verdict == "group_too_small":
            self._dropped["group_too_small"] += len(result.rollouts)
            self._counts["groups_dropped"] += 1
        elif verdict == "filtered":
            self._counts["filtered_groups"] += 1
        else:
            self._finished.append(_Finished(result, versions))

    # ---- internals: batch assembly (the trainer's thread, under the lock) -------------------

    def _screen_stale(self, version: int) -> None:
        """Drop or requeue the finished groups too old for `version`; their slots refill."""
        keep, requeue = [], []
        for f in self._finished:
            if self.force_on_policy:
                stale = any(v != version for c in f.versions for v in c)
            else:
                oldest = f.oldest
                stale = (
                    self.max_staleness is not None
                    and oldest is not None
                    and version - oldest > self.max_staleness
                )
            if not stale:
                keep.append(f)
            elif self.force_on_policy or self.stale_policy == "requeue":
                requeue.append(f.result.task)
            else:
                self._counts["stale_dropped"] += 1
        if len(keep) == len(self._finished):
            return
        self._finished = keep
        self._counts["stale_requeued"] += len(requeue)
        for t in sorted(requeue, key=lambda t: t.prompt_index, reverse=True):
            self._queue.appendleft((t.prompt_index, t.row, t.attempt + 1))  # first in line
        self._cond.notify_all()

    def _assemble(
        self, taken: list[_Finished], version: int, wait_s: float, occupancy: float
    ) -> Batch:
        tokens = lag_sum = mixed = rollouts = 0
        lag_min, lag_max = None, None
        for f in taken:
            for counts in f.versions:
                rollouts += 1
                mixed += len(counts) > 1
                for v, n in counts.items():
                    lag = version - v
                    tokens += n
                    lag_sum += lag * n
                    lag_min = lag if lag_min is None else min(lag_min, lag)
                    lag_max = lag if lag_max is None else max(lag_max, lag)
        c = self._counts
        metrics = {
            "pool/groups_finished": float(c["groups_finished"]),
            "pool/groups_dropped": float(c["groups_dropped"]),
            "pool/filtered_groups": float(c["filtered_groups"]),
            "pool/stale_dropped": float(c["stale_dropped"]),
            "pool/stale_requeued": float(c["stale_requeued"]),
            "pool/version_lag_mean": lag_sum / tokens if tokens else 0.0,
            "pool/version_lag_max": float(lag_max or 0),
            "pool/version_lag_min": float(lag_min or 0),
            "pool/mixed_version_rollouts": mixed / rollouts if rollouts else 0.0,
            "pool/occupancy": occupancy,
            "pool/wait_s": wait_s,
            "pool/surplus_groups": float(len(self._finished)),
        }
        dropped = dict(self._dropped)
        metrics.update({f"rollout/dropped/{r}": float(n) for r, n in dropped.items()})
        self._counts, self._dropped = Counter(), Counter()
        groups = sorted((f.result for f in taken), key=lambda g: g.task.prompt_index)
        return Batch(groups, metrics, dropped)


def _prompt_entry(prompt_index: int, row: dict[str, Any], attempt: int) -> dict[str, Any]:
    return {"prompt_index": prompt_index, "row": row, "attempt": attempt}
