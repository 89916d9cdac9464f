"""SIGTERM and SIGINT in the driver: waiting for a batch, a signal stops the loop at once;
inside a step's critical part it is held until the step ends, so weights, pool state and logs
stay consistent (a second signal stops at once)."""

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
    """`with GracefulStop() as stop:` installs it; `with stop.critical():` holds signals."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._failure: BaseException | None = None
        self._holding = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # signals reach it only
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._on_signal)
            self._previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_failure)
        return self

    def fail(self, error: BaseException) -> None:
        """From the engine watch: `error` is raised in the main thread now if a critical part is
        in progress (a refit waiting on a dead engine cannot finish), else as the next starts."""
        self._failure = error
        if self._holding:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None  # raised once only
        if failure is not None:
            raise failure

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
        name = signal.Signals(signum).name
        print(f"\n{name}: stopping after this step (send it again to stop now)", flush=True)

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
