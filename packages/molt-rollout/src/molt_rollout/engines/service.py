"""The generation side of a run, assembled: engines, router, refit control, token clients."""

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from molt_rollout.config import RefitConfig, RouterConfig, VLLMConfig
from molt_rollout.engines.client import TokenClient
from molt_rollout.engines.engine import EngineError, EngineGroup
from molt_rollout.engines.router import Router
from molt_rollout.network import SINGLE_NODE, Network
from molt_rollout.refit.adapters import AdapterServing
from molt_rollout.refit.control import Refitter, transfer_backend

log = logging.getLogger(__name__)


class EngineRestarted(Exception):  # noqa: N818 (not an error: news for the trainer)
    """An engine was restarted and waits for `RolloutService.rejoin` (raised by the pool)."""


@dataclass
class RolloutService:
    model: str
    vllm: VLLMConfig
    engines: EngineGroup
    router: Router
    engine_urls: list[str]
    workers_per_engine: int
    refitter: Refitter | None  # None when another process (the trainer's rank 0) drives refit
    adapters: AdapterServing | None = None  # the engines serve LoRA adapters (adapter refit)
    network: Network = SINGLE_NODE  # where servers listen, and the run's token
    restarts: int = 0  # engines restarted in this run (`engine/restarts`)
    _unjoined: set[int] = field(default_factory=set)  # restarted, not yet refit nor routed to
    _lock: threading.Lock = field(default_factory=threading.Lock)  # one restart at a time
    _stopped: threading.Event = field(default_factory=threading.Event)  # ends `watch`

    @classmethod
    def start(
        cls,
        model: str,
        vllm: VLLMConfig,
        router: RouterConfig,
        refit: RefitConfig,
        log_dir: str,
        on_gpu: bool,
        with_refitter: bool = True,
        placement=None,
        adapters: AdapterServing | None = None,
        network: Network = SINGLE_NODE,
    ) -> "RolloutService":
        """Engines (Ray initialised), router and, `with_refitter`, this process's refit rendezvous
        (else the trainer builds its Refitter); the engines hold version 0."""
        backend = transfer_backend(refit, on_gpu, colocated=placement is not None)
        engines = EngineGroup(vllm, model, backend, log_dir, on_gpu, placement, adapters, network)
        urls = engines.start()
        workers = vllm.tensor_parallel_size * vllm.data_parallel_size
        refitter = None
        try:
            router_process = Router(router, urls, log_dir, network)
            router_process.start()
            if with_refitter:
                refitter = Refitter(urls, workers, refit, on_gpu, network=network)
                refitter.init_transfer()
                refitter.set_version(0)
        except BaseException:
            engines.shutdown()
            raise
        return cls(model, vllm, engines, router_process, urls, workers, refitter, adapters, network)

    def watch(
        self, on_failure: Callable[[EngineError], None], on_restart: Callable[[], None]
    ) -> None:
        """Check the engines every 2 s on a daemon thread: a dead one is restarted and
        `on_restart` called (the trainer then `rejoin`s it); one that cannot be ends the watch
        with `on_failure(error)`."""

        def loop() -> None:
            while not self._stopped.wait(2.0):
                try:
                    if self.restart_dead():
                        on_restart()
                except EngineError as error:
                    on_failure(error)
                    return
                except Exception:  # Ray shutting down under us: nothing left to watch
                    return

        threading.Thread(target=loop, name="molt-engine-watch", daemon=True).start()

    def restart_dead(self) -> bool:
        """Replace every dead engine by a new server; True when one was, its EngineError when it
        cannot be. It leaves the router at once and joins again in `rejoin`, with weights."""
        with self._lock:
            dead = self.engines.dead()
            for index, error in dead.items():
                if not self.vllm.restart_on_failure:
                    raise error
                if self.restarts >= self.vllm.max_restarts:
                    used_up = f"--vllm.max_restarts {self.vllm.max_restarts} used up"
                    raise EngineError(f"{error} (not restarted: {used_up})")
                log.warning("restarting engine %d: %s", index, error)
                self.router.remove_worker(self.engine_urls[index])
                self.engine_urls[index] = self.engines.restart(index)
                self.restarts += 1
                self._unjoined.add(index)
            return bool(dead)

    def rejoin(self, refit: Callable[[list[str]], dict[str, float]]) -> dict[str, float]:
        """After a restart: `refit(engine_urls)` rebuilds the transfer group with every engine
        and sends the current weights; then the restarted engines join the router. Its timings,
        or {} when no engine was restarted since the last call."""
        self.restart_dead()
        with self._lock:
            if not self._unjoined:
                return {}
            times = refit(list(self.engine_urls))
            for index in sorted(self._unjoined):
                self.router.add_worker(self.engine_urls[index])
            self._unjoined.clear()
            return times

    def token_client(self) -> TokenClient:
        """A generator for molt-capture sessions and Env runners (one per event loop)."""
        vllm, adapter = self.vllm, self.adapters and self.adapters.name
        args = (self.router.url, self.model, vllm.request_timeout_s, vllm.max_retries)
        return TokenClient(*args, adapter=adapter, token=self.network.token)

    def shutdown(self) -> None:
        self._stopped.set()
        if self.refitter is not None:
            self.refitter.close()
        self.router.stop()
        self.engines.shutdown()
