"""`EngineWeights`: the engines' copy of the policy. A push sends the weights from the policy's
rank 0 into every engine, then tells the runners the version all serve. An engine the watch
restarted first rejoins, in a new weight-transfer group with every engine."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from molt_rollout.agents.runner_actors import RunnerActors
from molt_rollout.engines.service import RolloutService
from molt_rollout.refit.control import set_sleeping
from molt_train.config import RunConfig
from molt_train.model_group import ModelGroup


class EngineWeights:
    """`models`: the policy first; a waking engine needs the memory of them all."""

    def __init__(
        self,
        cfg: RunConfig,
        rollout: RolloutService,
        runners: RunnerActors,
        models: list[ModelGroup],
        run_dir: Path,
    ) -> None:
        self.cfg, self.rollout, self.runners, self.models = cfg, rollout, runners, models
        self.policy = models[0]
        self.adapter_dir = str((run_dir / "adapters").resolve())  # the adapter refit's
        self.pause_mode = "keep" if cfg.train.partial_rollout_enable else "wait"
        self._link(rollout.engine_urls)

    def _link(self, engine_urls: list[str]) -> None:
        """The policy's rank 0 joins a weight-transfer group with every engine worker."""
        rollout, cfg = self.rollout, self.cfg
        self.policy.init_refit(
            engine_urls,
            rollout.workers_per_engine,
            cfg.refit,
            cfg.train.colocate,
            rollout.adapters,
            self.adapter_dir,
            rollout.network,
        )

    def start(self, version: int, restored: bool) -> None:
        """The engines serve `version` from the first request: a resumed run's weights, or with
        the adapter refit a fresh run's adapter (B = 0), so every token takes the LoRA path."""
        if restored or self.rollout.adapters is not None:
            self.policy.refit(version)
        else:
            self.policy.set_engine_version(version)
        self.runners.tell_version(version)

    def push(self, version: int) -> dict[str, float]:
        try:
            times = self.rejoin(version) or self.policy.refit(version, self.pause_mode)
        except Exception:  # an engine died under the refit: restarted, it is refit with the rest
            if not (times := self.rejoin(version)):
                raise
        self.runners.tell_version(version)  # every engine serves it: no version read per request
        return times

    def rejoin(self, version: int) -> dict[str, float]:
        """Engines restarted since the last call get the weights; {} if none was."""
        return self.rollout.rejoin(functools.partial(self._relink_and_refit, version))

    def _relink_and_refit(self, version: int, engine_urls: list[str]) -> dict[str, float]:
        self._link(engine_urls)
        return self.policy.refit(version, self.pause_mode)

    @contextlib.contextmanager
    def asleep(self):
        """--vllm.enable_sleep_mode: the engines' GPU memory is the trainer's meanwhile."""
        if not self.cfg.vllm.enable_sleep_mode:
            yield
            return
        self._set_sleeping(True)
        yield
        for group in self.models:  # their allocators still hold the step's peak
            group.release_memory()
        self._set_sleeping(False)

    def _set_sleeping(self, sleeping: bool) -> None:
        urls, token = self.rollout.engine_urls, self.rollout.network.token
        set_sleeping(urls, sleeping, self.pause_mode, self.cfg.refit.timeout_s, token)
