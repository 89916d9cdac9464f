"""Server processes that end with their owner, however it ends: `spawn` runs a command under a
lifeline process that ends the command's process group when the owner is gone or asks;
`reap_descendants` kills what is left of a dead driver's process tree."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5
GRACE_S = 10.0  # for a stop asked by the owner
ORPHAN_GRACE_S = 2.0  # when the owner is gone


def spawn(command: list[str], grace_s: float = GRACE_S, **popen_kwargs) -> subprocess.Popen:
    """Start `command` tied to this process's life; returns the lifeline's Popen."""
    lifeline = [sys.executable, "-m", "molt_rollout.engines.lifeline", str(os.getpid())]
    command = [*lifeline, str(grace_s), "--", *command]
    return subprocess.Popen(command, start_new_session=True, **popen_kwargs)


def stop(process: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """End the group of a `spawn`ed process: SIGTERM, then SIGKILL after `grace_s`."""
    if process.poll() is None:
        _signal_group(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace_s + 2.0)  # the lifeline's own grace, and a little
    # Whatever is left: a lifeline stopped before its handler was installed leaves its server.
    _signal_group(process.pid, signal.SIGKILL)
    process.wait()


def reap_descendants() -> subprocess.Popen:
    """Start the watcher of this process's descendants (see the module doc)."""
    command = [sys.executable, "-m", "molt_rollout.engines.lifeline", "--reap", str(os.getpid())]
    # Not on the caller's output: a pipe reading the run (`| tee`) would stay open after it.
    quiet = dict.fromkeys(("stdin", "stdout", "stderr"), subprocess.DEVNULL)
    return subprocess.Popen(command, start_new_session=True, **quiet)


def _reap(owner: int) -> int:
    import psutil  # not in every lifeline: its import is slow

    known: dict[int, float] = {}  # pid -> start time: a pid reused later is not ours
    groups: set[int] = set()  # groups led by a descendant (lifelines): their members go too
    while _alive(owner):
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(owner).children(recursive=True):
                if p.pid in known or p.pid == os.getpid():
                    continue
                # A short-lived child can end between the listing and these calls: skip it.
                with contextlib.suppress(psutil.Error, ProcessLookupError):
                    known[p.pid] = p.create_time()
                    if os.getpgid(p.pid) == p.pid:
                        groups.add(p.pid)
        time.sleep(POLL_S)
    time.sleep(ORPHAN_GRACE_S)  # lifelines end their servers first; then whatever is left
    for pgid in groups:  # also members whose leader is already gone
        _signal_group(pgid, signal.SIGKILL)
    for pid, started in known.items():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.create_time() == started:
                p.kill()
    return 0


def end_with_parent() -> None:
    """SIGTERM to the calling process when its parent dies: a server's, before it starts, since
    Ray SIGKILLs an actor's children (lifelines too, which then cannot stop their servers) when
    the actor ends; and the `molt-train` driver's, under its command's process."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _alive(pid: int) -> bool:
    """Running, and not a zombie (a killed owner stays one until its parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def main(argv: list[str]) -> int:
    if argv[0] == "--reap":
        return _reap(int(argv[1]))
    owner, grace_s, command = int(argv[0]), float(argv[1]), argv[3:]
    stopping: list[int] = []  # the signal that asked for a stop, if one did
    for asking in (signal.SIGTERM, signal.SIGINT):
        signal.signal(asking, lambda signum, frame: stopping.append(signum))
    child = subprocess.Popen(command, preexec_fn=end_with_parent)  # inherits this group
    while child.poll() is None and not stopping and _alive(owner):
        time.sleep(POLL_S)
    if not stopping:  # the owner is gone: nobody waits for a graceful end
        grace_s = min(grace_s, ORPHAN_GRACE_S)
    # The server if it still runs, and any child it left behind; this process has a handler.
    _signal_group(os.getpgid(0), signal.SIGTERM)
    try:
        return child.wait(grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(os.getpgid(0), signal.SIGKILL)  # what is left, this process included
    return child.wait()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
