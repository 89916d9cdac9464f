"""The streaming prompt-group pool: up to K prompt groups stay outstanding while the trainer
trains, and `next_batch` hands out B finished ones, fresh enough for its weight version. One
background thread launches; one Condition guards all state. See docs/concepts/rollout.md."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from molt_capture.types import Rollout
from molt_rollout.agents.agent import Dropped
from molt_rollout.config import RolloutConfig

if TYPE_CHECKING:
    from molt_rollout.agents.data import PromptSource  # or any object with its three methods

log = logging.getLogger(__name__)

# Groups whose runner failed one after another (every outstanding slot, twice) before the pool
# stops and `next_batch` raises: a dead runner must not silently burn through the dataset.
RUNNER_ERROR_ROUNDS = 2
# pool/* counters, reported every batch (0 included)
COUNTED = ("groups_finished", "groups_dropped", "filtered_groups")
COUNTED += ("stale_dropped", "stale_requeued")


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
        """B, n and the stale policy come from `rollout`; K = `max_inflight_groups`;
        `max_staleness`: the most versions a trained token may lag (None: any)."""
        self.source, self.launch = source, launch
        self.batch_size, self.n = rollout.groups_per_batch, rollout.n_samples_per_prompt
        self.stale_policy, self.group_filter = rollout.stale_policy, group_filter
        self.max_inflight, self.max_staleness = max_inflight_groups, max_staleness
        self.force_on_policy, self.min_rollouts = force_on_policy, min_rollouts_per_group
        self._cond = threading.Condition()  # guards every attribute below
        self._queue: deque[dict[str, Any]] = deque()  # prompts launched before the source's
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
        """Stop the pool on an error from outside it (a dead engine): `next_batch` raises it."""
        with self._cond:
            self._failure = self._failure or error
            self._cond.notify_all()

    def interrupt(self, error: BaseException) -> None:
        """`next_batch` raises `error` once, now or at its next call; the pool keeps running."""
        with self._cond:
            self._interrupt = error
            self._cond.notify_all()

    def __enter__(self) -> RolloutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the trainer's side -----------------------------------------------------------------

    def next_batch(self, version: int, timeout_s: float | None = None) -> Batch:
        """B finished groups fresh enough for `version` (the batch's weights), by prompt index.
        Raises TimeoutError, StopIteration (the source ran out), RuntimeError (the pool stopped
        on an error), or the error given to `fail` or `interrupt` as it is."""
        t0 = time.monotonic()
        with self._cond:
            if not self._started or self._closed:
                raise RuntimeError("next_batch() needs a started, open pool: call start() first")
            if self.force_on_policy:
                self._want = self.batch_size
                self._cond.notify_all()
            try:
                if not self._cond.wait_for(lambda: self._ready(version), timeout_s):
                    raise TimeoutError(
                        f"next_batch waited {timeout_s} s: {len(self._finished)} of "
                        f"{self.batch_size} groups finished, {len(self._pending)} in "
                        f"flight, {len(self._queue)} queued"
                    )
                batch = self._assemble(version, time.monotonic() - t0)
            finally:
                if self.force_on_policy:
                    self._want = 0  # nothing generates while the trainer trains
            self._cond.notify_all()  # the launcher refills the slots just handed out
        return batch

    def _ready(self, version: int) -> bool:
        """Whether B finished groups pass the staleness check; raises what stops the wait."""
        if self._failure is not None:
            raise self._failure  # as given: it names its own cause
        if self._interrupt is not None:
            error, self._interrupt = self._interrupt, None
            raise error
        if self._error is not None:
            raise RuntimeError(f"rollout pool stopped: {self._error}") from self._error
        self._screen_stale(version)
        if len(self._finished) >= self.batch_size:
            return True
        if not self._pending and not self._queue and self._source_done:
            raise StopIteration(
                f"the prompt source ran out: {len(self._finished)} finished groups left, "
                f"{self.batch_size} needed"
            )
        return False

    # ---- exactly-once state ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The source's state and every prompt taken from it and not handed out (JSON-able)."""
        with self._cond:
            tasks = list(self._pending.values()) + [f.result.task for f in self._finished]
            outstanding = [_entry(t, t.attempt) for t in tasks]
            source, queued = self.source.state_dict(), list(self._queue)
            return {"source": source, "outstanding": outstanding, "queued": queued}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Before start(): the source, and the saved prompts first in line (each trained once)."""
        with self._cond:
            if self._started:
                raise RuntimeError("load_state_dict() must be called before start()")
            self.source.load_state_dict(d["source"])
            entries = sorted(d["outstanding"] + d["queued"], key=lambda e: e["prompt_index"])
            self._queue = deque(entries)

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
            entry = self._queue.popleft()
            index, row, attempt = entry["prompt_index"], entry["row"], entry["attempt"]
        elif self._source_done:
            return None
        else:
            try:
                index, row = self.source.next()
            except Exception as e:  # StopIteration: the source ran out
                if isinstance(e, StopIteration):
                    self._source_done = True
                else:
                    self._error = e
                self._cond.notify_all()  # a waiting next_batch may now know it cannot finish
                return None
            attempt = 0
        group = f"p{index}" if attempt == 0 else f"p{index}-r{attempt}"
        task = PromptTask(index, row, group, self.n, attempt)
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
            if verdict == "fatal":
                self._error = error
            elif verdict == "runner_error":
                self._runner_failed(task, error)
            else:
                self._record(result, verdict, versions)
            self._cond.notify_all()

    def _judge(self, result: GroupResult) -> tuple[str, list[Counter[int]]]:
        if len(result.rollouts) < self.min_rollouts:
            return "group_too_small", []
        if self.group_filter is not None and not self.group_filter(result):
            return "filtered", []
        return "kept", [trainable_versions(r) for r in result.rollouts]

    def _runner_failed(self, task: PromptTask, error: BaseException) -> None:
        log.warning("group %s failed in its runner: %r", task.group_id, error)
        self._dropped["runner_error"] += task.n
        self._counts["groups_dropped"] += 1
        self._runner_errors_in_row += 1
        if self._runner_errors_in_row >= RUNNER_ERROR_ROUNDS * max(self._want, self.batch_size):
            self._error = RuntimeError(
                f"{self._runner_errors_in_row} groups in a row failed in their runners; the "
                f"last: {error!r}"
            )

    def _record(self, result: GroupResult, verdict: str, versions: list[Counter[int]]) -> None:
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
            versions = {v for c in f.versions for v in c}
            bound = self.max_staleness
            lagging = bound is not None and version - min(versions, default=version) > bound
            stale = any(v != version for v in versions) if self.force_on_policy else lagging
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
        for t in sorted(requeue, key=lambda t: t.prompt_index, reverse=True):  # first in line
            self._queue.appendleft(_entry(t, t.attempt + 1))
        self._cond.notify_all()

    def _assemble(self, version: int, wait_s: float) -> Batch:
        occupancy = (len(self._pending) + len(self._finished)) / self._want
        taken, self._finished = self._finished[: self.batch_size], self._finished[self.batch_size :]
        lags: Counter[int] = Counter()  # trainable tokens by version lag
        rollouts = [counts for f in taken for counts in f.versions]
        for counts in rollouts:
            lags.update({version - v: n for v, n in counts.items()})
        tokens = sum(lags.values())
        mixed = sum(len(counts) > 1 for counts in rollouts)
        metrics = {f"pool/{k}": float(self._counts[k]) for k in COUNTED} | {
            "pool/version_lag_mean": sum(lag * n for lag, n in lags.items()) / max(tokens, 1),
            "pool/version_lag_max": float(max(lags, default=0)),
            "pool/version_lag_min": float(min(lags, default=0)),
            "pool/mixed_version_rollouts": mixed / max(len(rollouts), 1),
            "pool/occupancy": occupancy,
            "pool/wait_s": wait_s,
            "pool/surplus_groups": float(len(self._finished)),
        }
        dropped = dict(self._dropped)
        metrics.update({f"rollout/dropped/{r}": float(n) for r, n in dropped.items()})
        self._counts, self._dropped = Counter(), Counter()
        groups = sorted((f.result for f in taken), key=lambda g: g.task.prompt_index)
        return Batch(groups, metrics, dropped)


def _entry(task: PromptTask, attempt: int) -> dict[str, Any]:
    return {"prompt_index": task.prompt_index, "row": task.row, "attempt": attempt}
