"""The generation side of a run, assembled: engines, router, refit control, token clients."""

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from molt_rollout.client import TokenClient
from molt_rollout.config import RefitConfig, RouterConfig, VLLMConfig
from molt_rollout.engine import EngineError, EngineGroup
from molt_rollout.refit import Refitter, transfer_backend
from molt_rollout.router import Router


@dataclass
class RolloutService:
    model: str
    vllm: VLLMConfig
    engines: EngineGroup
    router: Router
    engine_urls: list[str]
    workers_per_engine: int
    refitter: Refitter | None  # None when another process (the trainer's rank 0) drives refit
    _stopped: threading.Event = field(default_factory=threading.Event)  # ends `watch`

    @classmethod
    def start(cls, model: str, vllm: VLLMConfig, router: RouterConfig, refit: RefitConfig,
              log_dir: str, on_gpu: bool | None = None,
              with_refitter: bool = True, placement=None) -> "RolloutService":  # fmt: skip
        """Start engines (Ray must be initialised), then the router, then (with_refitter) the
        refit rendezvous in this process; the engines' weights are version 0. A trainer that
        sends weights from its own process passes with_refitter=False and builds a `Refitter`
        from `engine_urls` and `workers_per_engine` there. The configs were validated at
        start-up (molt_rollout.config.validate_rollout_config). `placement`: the GPU bundles
        shared with the trainer when colocated (EngineGroup)."""
        on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
        backend = transfer_backend(refit, on_gpu, colocated=placement is not None)
        engines = EngineGroup(vllm, model, backend, log_dir, on_gpu, placement)
        urls = engines.start()
        try:
            router_process = Router(router, urls, log_dir)
            router_process.start()
            workers = vllm.tensor_parallel_size * vllm.data_parallel_size
            refitter = None
            if with_refitter:
                refitter = Refitter(urls, workers, refit, on_gpu)
                refitter.init_transfer()
                refitter.set_version(0)
        except BaseException:
            engines.shutdown()
            raise
        return cls(model, vllm, engines, router_process, urls, workers, refitter)

    def watch(self, on_death: Callable[[EngineError], None], every_s: float = 2.0) -> None:
        """Check the engines every `every_s` seconds on a daemon thread; call `on_death` with
        the EngineError (its log tail included) of the first one found dead, then stop."""

        def loop() -> None:
            while not self._stopped.wait(every_s):
                try:
                    self.engines.check()
                except EngineError as error:
                    on_death(error)
                    return
                except Exception:  # Ray shutting down under us: nothing left to watch
                    return

        threading.Thread(target=loop, name="molt-engine-watch", daemon=True).start()

    def token_client(self) -> TokenClient:
        """A generator for molt-capture sessions and Env runners (one per event loop)."""
        return TokenClient(
            self.router.url, self.model, self.vllm.request_timeout_s, self.vllm.max_retries
        )

    def shutdown(self) -> None:
        self._stopped.set()
        if self.refitter is not None:
            self.refitter.close()
        self.router.stop()
        self.engines.shutdown()
