"""A run's parts, started in order: the run directory; the engines, with the runners and models
built meanwhile; the pool; the engines' weights; a resumed run's state. `Run.close` ends them."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import time
from pathlib import Path

import ray

from molt_algos import estimator_needs, kl_controller
from molt_rollout.agents.data import PromptSource
from molt_rollout.agents.eval import eval_rollout_config
from molt_rollout.agents.pool import GroupResult, RolloutPool
from molt_rollout.agents.runner_actors import RunnerActors
from molt_rollout.engines.engine import COLOCATED_GPU_SHARE, gpu_bundles
from molt_rollout.engines.service import EngineRestarted, RolloutService
from molt_rollout.engines.tiny_model import build_tiny_model
from molt_rollout.network import Network
from molt_rollout.refit.control import set_sleeping
from molt_train.checkpoint import BestTracker, CheckpointManager
from molt_train.config import RunConfig, adapter_serving, model_configs, trained_staleness
from molt_train.experience import reuses_training_forward
from molt_train.logger import MetricsLogger, format_final_message
from molt_train.model_group import ModelGroup
from molt_train.signals import GracefulStop
from molt_train.validate import validate_run_config


class Run:
    """Everything a run started, and the state its checkpoints hold."""

    def __init__(self, cfg: RunConfig, stop: GracefulStop, source: PromptSource, eval_rows: list):
        cluster_gpus = int(ray.cluster_resources().get("GPU", 0))
        validate_run_config(cfg, cluster_gpus)
        cfg, run_dir = prepare_run_dir(cfg)
        self.cfg, self.run_dir, self.stop, self.eval_rows = cfg, run_dir, stop, eval_rows
        parts = start_parts(cfg, run_dir, cluster_gpus > 0)
        self.bundles, self.rollout, self.runners, self.policy, self.reference, self.critic = parts
        self.models = [m for m in (self.policy, self.reference, self.critic) if m is not None]
        # The models a checkpoint holds, by role.
        self.trained = {"policy": self.policy} | ({"critic": self.critic} if self.critic else {})
        self.runners.connect(self.rollout.router.url)
        groups = estimator_needs(cfg.algo.advantage.estimator).groups
        self.pool = RolloutPool(
            source,
            self.runners.launch,
            cfg.rollout,
            max_inflight_groups=cfg.rollout.groups_per_batch * (1 + cfg.train.async_queue_size),
            max_staleness=trained_staleness(cfg),
            force_on_policy=cfg.train.force_on_policy,
            min_rollouts_per_group=2 if groups else 1,  # a group baseline compares two at least
            group_filter=keep_informative_group if cfg.algo.dynamic_filtering_enable else None,
        )
        self.weights = EngineWeights(self)
        algo, ckpt = cfg.algo, cfg.ckpt
        self.kl_ctl = kl_controller(algo.advantage.kl_coef, algo.kl.target, algo.kl.horizon)
        self.checkpoints = CheckpointManager(str(run_dir / "checkpoints"), ckpt.keep_last)
        self.best = BestTracker(ckpt.best_metric, ckpt.best_mode) if ckpt.best_metric else None
        self.reuse = reuses_training_forward(cfg)  # the old log-probs: the training forward's
        self.first_step = 0  # the weight version is the number of optimizer steps taken
        resumed_at = self.resume()
        self.logger = MetricsLogger(cfg.logger, str(run_dir), dataclasses.asdict(cfg), resumed_at)
        self.weights.start(self.first_step, restored=resumed_at is not None)
        self.pool.start()
        # A dead engine is restarted on the watch's thread (--vllm.restart_on_failure); one that
        # cannot be stops the run within seconds, with its log tail.
        self.rollout.watch(on_failure=self.engine_failed, on_restart=self.engine_restarted)

    def resume(self) -> int | None:
        """Continue from the latest checkpoint (--ckpt.resume): the step it continues from."""
        latest = self.checkpoints.latest() if self.cfg.ckpt.resume else None
        if latest is None:
            return None
        state = self.checkpoints.load(latest, self.trained)
        self.first_step = state["step"]
        self.pool.load_state_dict(state["pool"])
        self.kl_ctl.load_state_dict(state["kl_controller"])
        if self.best is not None and state.get("best"):
            self.best.load_state_dict(state["best"])
        print(f"resumed from {latest} at step {self.first_step}")
        return self.first_step

    def save(self, step: int) -> int:
        best, kl = self.best and self.best.state_dict(), self.kl_ctl.state_dict()
        state = {"step": step, "pool": self.pool.state_dict(), "kl_controller": kl, "best": best}
        self.checkpoints.save(step, self.trained, state)
        return step

    def engine_failed(self, error: Exception) -> None:
        """From the engine watch: a waiting pool and a step in progress both stop at once."""
        self.pool.fail(error)
        self.stop.fail(error)

    def engine_restarted(self) -> None:
        self.pool.interrupt(EngineRestarted())  # wakes a waiting trainer to rejoin it

    def close(self) -> None:
        self.pool.close()
        paths = self.logger.close()
        self.runners.shutdown()
        for group in self.models:
            group.shutdown()
        self.rollout.shutdown()
        if self.bundles is not None:
            ray.util.remove_placement_group(self.bundles)
        print(format_final_message(paths, str(self.run_dir / "checkpoints")))


class EngineWeights:
    """The engines' copy of the policy: a push sends it from the policy's rank 0 into every engine
    (one the watch restarted first rejoins), then tells the runners the version all serve."""

    def __init__(self, run: Run) -> None:
        self.cfg, self.rollout, self.runners = run.cfg, run.rollout, run.runners
        self.policy, self.models = run.policy, run.models  # a waking engine needs all their memory
        self.adapter_dir = str((run.run_dir / "adapters").resolve())  # the adapter refit's
        self.pause_mode = "keep" if run.cfg.train.partial_rollout_enable else "wait"
        self._link(run.rollout.engine_urls)

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

        def relink_and_refit(engine_urls: list[str]) -> dict[str, float]:
            self._link(engine_urls)
            return self.policy.refit(version, self.pause_mode)

        return self.rollout.rejoin(relink_and_refit)

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


def prepare_run_dir(cfg, kind: str = "run"):
    """The run directory of a RunConfig or SFTConfig, with its model and name in config.json."""
    model = cfg.actor.model_path or str(build_tiny_model())
    name = cfg.logger.run_name or time.strftime(f"{kind}-%Y%m%d-%H%M%S")
    actor = dataclasses.replace(cfg.actor, model_path=model)
    logger = dataclasses.replace(cfg.logger, run_name=name)
    cfg = dataclasses.replace(cfg, actor=actor, logger=logger)
    run_dir = Path(cfg.train.output_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    return cfg, run_dir


def start_parts(cfg: RunConfig, run_dir: Path, on_gpu: bool) -> tuple:
    """(bundles, rollout, runners, policy, reference, critic), the engines started while the rest
    is built; colocated, one after the other (vLLM sizes its KV cache from the free memory)."""
    models = model_configs(cfg)
    bundles = share = None
    if cfg.train.colocate:
        bundles = gpu_bundles(max(model.num_workers for model in models.values()))
        # In Ray's books the engine takes a share of each bundle, the models the rest (its grain
        # is 1e-4).
        share = (bundles, int((1 - COLOCATED_GPU_SHARE) / len(models) * 1e4) / 1e4)
    adapters = adapter_serving(cfg)  # --actor.lora.refit adapter: the engines serve adapters
    network = Network.of_cluster()  # one node: loopback, no token; several: with a token
    start_rollout = functools.partial(
        RolloutService.start,
        cfg.actor.model_path,
        cfg.vllm,
        cfg.router,
        cfg.refit,
        str(run_dir / "logs"),
        on_gpu,
        with_refitter=False,
        placement=bundles,
        adapters=adapters,
        network=network,
    )
    # The runners load the agent module while the engines start, and dial the router once it is up.
    runners = functools.partial(
        RunnerActors,
        cfg.rollout,
        cfg.train.agent_path,
        cfg.actor.model_path,
        cfg.data.apply_chat_template,
        cfg.vllm.request_timeout_s,
        cfg.vllm.max_retries,
        eval_rollout_config(cfg.rollout, cfg.eval),
        adapters and adapters.name,
        network.token,
    )
    builders = [runners]
    # The policy compares its MoE routing with the engine's, or replays it.
    compare = "compare" if cfg.vllm.enable_return_routed_experts else None
    routing = {"policy": "replay" if cfg.train.routing_replay else compare}
    for role in ("policy", "reference", "critic"):  # no reference or critic: None
        model = functools.partial(
            ModelGroup, models.get(role), cfg.fsdp, role, on_gpu, routing.get(role), share
        )
        builders.append(model if role in models else lambda: None)
    if bundles is None:
        return None, *start_concurrently(start_rollout, *builders)
    runners = builders[0]()
    return bundles, start_rollout(), runners, *(build() for build in builders[1:])


def start_concurrently(start_rollout, *builders) -> tuple:
    """(rollout, *built): the engines start on a thread while `builders` run here in order (two
    threads importing transformers' and AutoModel's stacks can see each other's modules
    half-initialised). Whichever fails, the rest is shut down."""
    built = []
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="molt-start") as executor:
        rollout_future = executor.submit(start_rollout)
        try:
            for build in builders:
                built.append(build())
            return rollout_future.result(), *built
        except BaseException:
            for part in built:
                if part is not None:
                    with contextlib.suppress(Exception):
                        part.shutdown()
            with contextlib.suppress(Exception):  # waits for a start still in progress
                rollout_future.result().shutdown()
            raise


def keep_informative_group(group: GroupResult) -> bool:
    """Dynamic sampling: a group whose samples all scored the same has zero group-relative
    advantage everywhere and teaches nothing; the pool backfills its slot."""
    return len({r.reward if r.score is None else r.score for r in group.rollouts}) > 1
