"""`start_concurrently`: the engines start on a thread while the runners and the model groups
are built in order; whichever fails, everything already started is shut down. The real parts run in
the molt-train integration tests (tests_integration/test_train.py); these fakes pin the
order and the failure paths, which those cannot provoke on demand."""

import threading

import pytest

from molt_train.run import start_concurrently


class Part:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def shutdown(self) -> None:
        self.log.append(f"{self.name} shut down")


def test_builders_run_while_the_rollout_starts():
    log: list[str] = []
    built = threading.Event()

    def start_rollout() -> Part:
        assert built.wait(5)  # returns only once the builders ran: they overlap the start
        return Part("rollout", log)

    def build_runners() -> Part:
        built.set()
        return Part("runners", log)

    rollout, runners, policy, reference = start_concurrently(
        start_rollout, build_runners, lambda: Part("policy", log), lambda: None
    )
    assert (rollout.name, runners.name, policy.name, reference) == (
        "rollout",
        "runners",
        "policy",
        None,
    )
    assert log == []


def test_a_failing_builder_shuts_down_what_was_started():
    log: list[str] = []

    def failing_policy() -> Part:
        raise RuntimeError("policy failed")

    with pytest.raises(RuntimeError, match="policy failed"):
        start_concurrently(
            lambda: Part("rollout", log), lambda: Part("runners", log), lambda: None, failing_policy
        )
    assert log == ["runners shut down", "rollout shut down"]


def test_a_failing_rollout_shuts_down_the_built_parts():
    log: list[str] = []

    def failing_rollout() -> Part:
        raise RuntimeError("engine 0 exited")

    with pytest.raises(RuntimeError, match="engine 0 exited"):
        start_concurrently(
            failing_rollout, lambda: Part("runners", log), lambda: Part("policy", log)
        )
    assert log == ["runners shut down", "policy shut down"]
