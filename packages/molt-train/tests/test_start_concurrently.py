"""`start_concurrently`: the engines, the runners and each model group start on threads of
their own; whichever fails, everything else is shut down once started. The real parts run in
the molt-train integration tests (tests_integration/test_train.py); these fakes pin the
order and the failure paths, which those cannot provoke on demand."""

import threading
import time

import pytest

from molt_train.loop import start_concurrently


class Part:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def shutdown(self) -> None:
        self.log.append(f"{self.name} shut down")


def test_every_part_starts_while_the_others_do():
    log: list[str] = []
    runners_started, policy_started = threading.Event(), threading.Event()

    def start_rollout() -> Part:
        assert policy_started.wait(5)  # returns only once the builders ran: they overlap
        return Part("rollout", log)

    def build_runners() -> Part:
        runners_started.set()
        return Part("runners", log)

    def build_policy() -> Part:
        policy_started.set()
        return Part("policy", log)

    def build_critic() -> Part:
        assert runners_started.wait(5) and policy_started.wait(5)  # the critic overlaps them too
        return Part("critic", log)

    parts = start_concurrently(start_rollout, build_runners, build_policy, lambda: None,
                               build_critic)  # fmt: skip
    assert [p and p.name for p in parts] == ["rollout", "runners", "policy", None, "critic"]
    assert log == []


def test_a_failing_builder_shuts_down_what_was_started():
    log: list[str] = []

    def failing_policy() -> Part:
        raise RuntimeError("policy failed")

    with pytest.raises(RuntimeError, match="policy failed"):
        start_concurrently(lambda: Part("rollout", log), lambda: Part("runners", log),
                           failing_policy, lambda: None, lambda: Part("critic", log))  # fmt: skip
    assert sorted(log) == ["critic shut down", "rollout shut down", "runners shut down"]


def test_a_failing_rollout_shuts_down_the_built_parts_after_their_start():
    log: list[str] = []
    slow_policy_done = threading.Event()

    def failing_rollout() -> Part:
        raise RuntimeError("engine 0 exited")

    def slow_policy() -> Part:
        time.sleep(0.2)  # still starting when the rollout fails: shut down once built
        slow_policy_done.set()
        return Part("policy", log)

    with pytest.raises(RuntimeError, match="engine 0 exited"):
        start_concurrently(failing_rollout, lambda: Part("runners", log), slow_policy)
    assert slow_policy_done.is_set()
    assert sorted(log) == ["policy shut down", "runners shut down"]
