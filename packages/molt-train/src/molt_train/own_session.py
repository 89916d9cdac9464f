"""The `molt-train` command's process: the run in a session of its own, under a parent that
passes signals on.

A terminal's Ctrl-C, `timeout` and many job runners signal a whole process group. The run's Ray
processes (its GCS, raylet and workers) share the driver's group, so they would take the signal
too and go down while the driver still needs them to finish its step, save and shut down: on
the H200 a group SIGTERM left the driver waiting 60 s on its lost GCS with the GPU's memory
held (docs/benchmarks.md, "H200 run7"). So the command forks first thing: the child runs the
driver in a new session, out of reach of group signals; the parent stays in the caller's group,
passes each SIGINT and SIGTERM on to the child alone (SIGHUP, the terminal closing, as SIGTERM:
a stop that saves) and exits with the child's status, 128 + N if signal N ended it. A killed
parent stops the child with SIGTERM (PR_SET_PDEATHSIG). What a dying driver leaves is ended by
its own reaper (`molt_rollout.lifeline.reap_descendants`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import typing

from molt_rollout.lifeline import end_with_parent


def run_in_own_session() -> None:
    """Returns in the child, in its new session; the parent waits for it and exits."""
    if not hasattr(os, "setsid"):  # not POSIX: run in place
        return
    sys.stdout.flush(), sys.stderr.flush()  # else their buffers would be written twice
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        os.setsid()
        end_with_parent()
        if os.getppid() != parent:  # the parent died before the line above took effect
            os.kill(os.getpid(), signal.SIGTERM)
        return
    _wait_and_exit(child)


def _wait_and_exit(child: int) -> typing.NoReturn:
    def forward(signum: int, frame) -> None:
        with contextlib.suppress(ProcessLookupError):  # it has just ended: waitpid returns
            os.kill(child, signal.SIGTERM if signum == signal.SIGHUP else signum)

    # SIGINT and SIGTERM even where they came in ignored (a shell's background job ignores
    # SIGINT): the driver's own handlers take them. `nohup`'s ignored SIGHUP stays ignored.
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, forward)
    _, status = os.waitpid(child, 0)  # retried after each forwarded signal (PEP 475)
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)
