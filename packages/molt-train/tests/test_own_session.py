"""molt_train.cli.run_in_own_session with real processes: a program that calls it, then records
the signals it and a process of its own group (as Ray's processes are) receive."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

PROGRAM = """
import os, signal, subprocess, sys, time
from molt_train.cli import run_in_own_session

run_in_own_session()
log = sys.argv[1]

def record(who):
    def handler(signum, frame):
        with open(log, "a") as f:
            f.write(f"{who} {signal.Signals(signum).name}\\n")
        sys.exit(3)
    return handler

for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, record("driver"))
member = subprocess.Popen([sys.executable, "-c", sys.argv[2], log])  # in the driver's group
time.sleep(0.5)
with open(log, "a") as f:
    f.write(f"ready {os.getpid()} {os.getsid(0)} {member.pid}\\n")
time.sleep(60)
"""
MEMBER = """
import signal, sys, time
def handler(signum, frame):
    with open(sys.argv[1], "a") as f:
        f.write(f"member {signal.Signals(signum).name}\\n")
for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, handler)
time.sleep(60)
"""


@pytest.fixture
def launched(tmp_path, request):
    """(the command's process, its log, the driver's pid, the group member's pid). Parametrised
    indirectly: {signal: disposition} the command starts with (a shell's background job ignores
    SIGINT, `nohup` SIGHUP), SIGHUP's default otherwise (whatever ran pytest may ignore it)."""
    log = tmp_path / "signals.log"
    dispositions = {signal.SIGHUP: signal.SIG_DFL, **getattr(request, "param", {})}

    def start() -> None:
        for signum, disposition in dispositions.items():
            signal.signal(signum, disposition)

    command = subprocess.Popen(
        [sys.executable, "-c", PROGRAM, str(log), MEMBER], start_new_session=True, preexec_fn=start
    )
    deadline = time.monotonic() + 30
    while "ready" not in (log.read_text() if log.exists() else ""):
        assert command.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    _, driver, session, member = log.read_text().split()
    try:
        assert int(session) == int(driver) != os.getsid(command.pid)  # a session of its own
        yield command, log, int(driver), int(member)
    finally:
        for pid in (command.pid, int(driver), int(member)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        command.wait()


def records(log, expected: int) -> list[str]:
    deadline = time.monotonic() + 10
    while len(lines := log.read_text().splitlines()[1:]) < expected:
        assert time.monotonic() < deadline, lines
        time.sleep(0.05)
    time.sleep(0.3)  # any further line (which would be wrong) has time to arrive
    return log.read_text().splitlines()[1:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_group_signal_reaches_the_driver_alone(launched, sig):
    """As a terminal's Ctrl-C and `timeout` send it: the driver gets it once, the processes of
    its group (Ray's) not at all; the command exits with the driver's code."""
    command, log, _, _ = launched
    os.killpg(command.pid, sig)
    assert records(log, 1) == [f"driver {sig.name}"]
    assert command.wait(timeout=10) == 3


@pytest.mark.parametrize(
    "launched", [{signal.SIGINT: signal.SIG_IGN}], indirect=True, ids=["SIGINT-ignored"]
)
def test_a_group_sigint_reaches_the_driver_of_a_background_job(launched):
    """A shell starts a background job with SIGINT ignored; the driver's own handler takes it
    all the same, so the command passes it on."""
    command, log, _, _ = launched
    os.killpg(command.pid, signal.SIGINT)
    assert records(log, 1) == ["driver SIGINT"]
    assert command.wait(timeout=10) == 3


def test_a_hangup_stops_the_driver_as_sigterm_does(launched):
    command, log, _, _ = launched
    command.send_signal(signal.SIGHUP)
    assert records(log, 1) == ["driver SIGTERM"]
    assert command.wait(timeout=10) == 3


@pytest.mark.parametrize(
    "launched", [{signal.SIGHUP: signal.SIG_IGN}], indirect=True, ids=["nohup"]
)
def test_under_nohup_a_hangup_leaves_the_run_going(launched):
    command, log, _, _ = launched
    command.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert command.poll() is None and log.read_text().splitlines()[1:] == []


def test_a_killed_driver_ends_the_command_with_128_plus_the_signal(launched):
    command, _, driver, _ = launched
    os.kill(driver, signal.SIGKILL)
    assert command.wait(timeout=10) == 128 + signal.SIGKILL


def test_a_killed_command_stops_the_driver_with_sigterm(launched):
    command, log, _, _ = launched
    command.kill()
    assert records(log, 1) == ["driver SIGTERM"]
