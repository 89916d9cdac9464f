"""SIGTERM and SIGINT in the driver: stop at the next safe point, in a bounded time.

While the loop waits for a batch (or evaluates) a signal stops it at once: nothing of the step
has reached the weights yet. Inside a step's critical part (experience, optimizer steps, refit,
logging, checkpoint) the signal is held until the step ends, so weights, pool state and logs
stay consistent with each other; a second signal stops at once anyway. The loop then writes
its final checkpoint (`--ckpt.save_on_exit`), shuts everything down and the CLI exits with
128 + the signal number, without a traceback.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class Stopped(BaseException):  # noqa: N818 (not an error: a requested stop)
    """Raised in the driver's main thread by SIGTERM or SIGINT."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class GracefulStop:
    """Install with `with GracefulStop() as stop:`; wrap a step's critical part in
    `with stop.critical():`."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._failure: BaseException | None = None
        self._failure_raised = False
        self._holding = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # signals reach it only
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._on_signal)
            self._previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_failure)
        return self

    def fail(self, error: BaseException) -> None:
        """From another thread (the engine watchdog): a critical part in progress cannot finish
        (a refit waiting on a dead engine), so `error` is raised in the main thread now; one
        about to start raises it as it starts. Outside them the caller ends the wait itself
        (the pool), and `error` is raised once only."""
        self._failure = error
        if self._holding:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    def _raise_failure(self) -> None:
        if self._failure is not None and not self._failure_raised:
            self._failure_raised = True
            raise self._failure

    def _on_failure(self, signum: int, frame) -> None:
        if self._holding:  # else the step ended meanwhile: the pool raises it instead
            self._raise_failure()

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame) -> None:
        again = self.signum is not None
        self.signum = signum
        if not self._holding or again:
            raise Stopped(signum)
        print(f"\n{signal.Signals(signum).name}: stopping after this step "
              "(send it again to stop now)", flush=True)  # fmt: skip

    @contextlib.contextmanager
    def critical(self):
        self._raise_failure()
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self.signum is not None:
            raise Stopped(self.signum)
