"""Spawned servers end with their owner: SIGKILL of the owner, stop(), and a server's own exit."""

import os
import subprocess
import sys
import time

from molt_rollout.engines import lifeline

# A "server" with a child of its own (like vLLM's engine core): prints both pids, then waits.
SERVER = (
    "import subprocess, sys, time; "
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
    "print(c.pid, flush=True); time.sleep(120)"
)
OWNER = (
    "import sys, time; from molt_rollout.engines import lifeline; "
    f"p = lifeline.spawn([sys.executable, '-c', {SERVER!r}], grace_s=1.0, stdout=sys.stdout); "
    "time.sleep(120)"
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_a_killed_owner_takes_the_server_and_its_children():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    grandchild = int(owner.stdout.readline())
    assert alive(grandchild)
    owner.kill()  # SIGKILL: no cleanup code of the owner runs
    owner.wait()
    assert wait_gone([grandchild]) == []


def test_stop_ends_the_group_and_a_server_exit_code_passes_through():
    process = lifeline.spawn([sys.executable, "-c", SERVER], grace_s=1.0, stdout=subprocess.PIPE)
    grandchild = int(process.stdout.readline())
    lifeline.stop(process, grace_s=1.0)
    assert process.poll() is not None
    assert wait_gone([grandchild]) == []

    process = lifeline.spawn([sys.executable, "-c", "raise SystemExit(3)"], grace_s=1.0)
    assert process.wait(30) == 3


def test_a_server_ignoring_sigterm_is_killed_after_the_grace():
    stubborn = (
        "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print(os.getpid(), flush=True); time.sleep(120)"
    )
    process = lifeline.spawn([sys.executable, "-c", stubborn], grace_s=0.5, stdout=subprocess.PIPE)
    server = int(process.stdout.readline())
    t0 = time.monotonic()
    lifeline.stop(process, grace_s=0.5)
    assert wait_gone([server], timeout_s=1.0) == []
    assert time.monotonic() - t0 < 5


def test_the_reaper_kills_every_descendant_of_a_killed_owner():
    """A driver's tree that does not watch for its parent (like Ray's workers) still ends."""
    sleeper = "import time; time.sleep(120)"
    tree = (
        "import subprocess, sys, time; "
        f"c = subprocess.Popen([sys.executable, '-c', {sleeper!r}], start_new_session=True); "
        "print(c.pid, flush=True); time.sleep(120)"
    )
    owner_code = (
        "import subprocess, sys, time; from molt_rollout.engines import lifeline; "
        "lifeline.reap_descendants(); "
        f"p = subprocess.Popen([sys.executable, '-c', {tree!r}], stdout=sys.stdout); "
        "time.sleep(120)"
    )
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True)
    grandchild = int(owner.stdout.readline())
    time.sleep(5.0)  # the reaper has seen the tree (it polls every 0.5 s once started)
    owner.kill()  # not reaped yet: a zombie owner counts as gone
    assert wait_gone([grandchild], timeout_s=10) == []
    owner.wait()


def test_the_reaper_outlives_a_child_that_ends_while_it_looks(monkeypatch):
    """A descendant can exit between the reaper's listing and its own calls (the engine core's
    short-lived compiler probes do): the reaper goes on watching, then kills the rest."""
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "c = subprocess.Popen(['sleep', '120']); print(c.pid, flush=True); time.sleep(2)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(owner.stdout.readline())

    def vanished(pid: int) -> int:
        raise ProcessLookupError(3, "No such process")  # as for a child gone since the listing

    monkeypatch.setattr(lifeline.os, "getpgid", vanished)
    # First seen by pid and start time, then getpgid fails: still killed once the owner ends.
    assert lifeline._reap(owner.pid) == 0
    assert wait_gone([child]) == []
    owner.wait()


def test_a_killed_lifeline_takes_its_server():
    """Ray SIGKILLs an ending actor's children, the lifeline among them: the server it started
    must not outlive it."""
    server = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"
    process = lifeline.spawn([sys.executable, "-c", server], grace_s=1.0, stdout=subprocess.PIPE)
    pid = int(process.stdout.readline())
    process.kill()  # the lifeline alone, no cleanup code of it runs
    process.wait()
    assert wait_gone([pid]) == []
