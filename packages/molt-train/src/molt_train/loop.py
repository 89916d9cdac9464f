"""The RL loop. `train(cfg)` checks the config, the agent module and the data (a user error
fails here, before Ray starts), then `_run` reads top to bottom:

    start engines and router, building the runners and the policy actor (and the reference
        and critic when asked for) meanwhile
    build the streaming pool
    every step: take a batch from the pool -> make experience -> train -> refit -> log
                evaluate and checkpoint on their cadence

Engines keep generating the next groups while the actor trains (unless --train.force_on_policy);
the weight version is the optimizer step count, and every trained token carries the version
that sampled it. SIGTERM and SIGINT stop it at the next safe point (molt_train.signals).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import time
from pathlib import Path

import ray

from molt_algos import GROUP_ESTIMATORS, kl_controller
from molt_rollout import lifeline
from molt_rollout.data import DataConfig, PromptSource, load_eval_rows
from molt_rollout.engine import COLOCATED_GPU_SHARE, gpu_bundles
from molt_rollout.eval import eval_metrics, eval_rollout_config, run_eval
from molt_rollout.network import Network
from molt_rollout.pool import Batch, GroupResult, RolloutPool
from molt_rollout.refit import set_sleeping
from molt_rollout.runner_actors import RunnerActors
from molt_rollout.service import EngineRestarted, RolloutService
from molt_rollout.tiny_model import build_tiny_model
from molt_train.actor_config import ActorConfig
from molt_train.checkpoint import BestTracker, CheckpointManager
from molt_train.config import (
    RunConfig,
    StartupError,
    adapter_serving,
    model_ranks,
    model_roles,
    resolved,
    validate_agent,
    validate_devices,
    validate_run_config,
)
from molt_train.experience import correction_metrics, make_experience, reuses_training_forward
from molt_train.logger import MetricsLogger, format_final_message
from molt_train.metrics import rollout_metrics, sample_rows
from molt_train.model_group import ModelGroup
from molt_train.signals import GracefulStop, Stopped


def train(cfg: RunConfig) -> dict[str, float]:
    """Run RL as configured; returns the last step's metrics. Bad settings raise StartupError
    before Ray starts (the device checks right after), naming the flags."""
    validate_run_config(cfg)
    cfg = resolved(cfg)
    validate_agent(cfg)  # a broken agent module fails here, in the driver, by name
    source, eval_rows = load_prompts(cfg.data)  # so does a bad data file, naming file and row
    lifeline.reap_descendants()  # a SIGKILLed driver leaves no process of the run behind
    start_ray(cfg)  # ray.init installs its own SIGTERM handler (sys.exit): ours comes after
    with GracefulStop() as stop:
        return _run(cfg, stop, source, eval_rows)


def _run(cfg: RunConfig, stop: GracefulStop, source: PromptSource, eval_rows: list[dict]):
    cluster_gpus = int(ray.cluster_resources().get("GPU", 0))
    validate_devices(cfg, cluster_gpus)
    on_gpu = cluster_gpus > 0
    model = cfg.actor.model_path or str(build_tiny_model())
    # The resolved config names the model that trained.
    cfg = dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, model_path=model))
    cfg, run_dir = prepare_run_dir(cfg)
    # One node: loopback, no token. Several: each server on its node's address, with a token.
    network = Network.of_cluster()

    # ---- engines and router, the policy actor built meanwhile (all mostly wait on imports) -
    # Colocated: one-GPU bundles that the engine and every model's rank i share; in Ray's books
    # the engine takes half of each, the models the other half.
    bundles = gpu_bundles(max(model_ranks(cfg))) if cfg.train.colocate else None
    left = (1 - COLOCATED_GPU_SHARE) / len(model_roles(cfg))
    share = None if bundles is None else (bundles, int(left * 1e4) / 1e4)  # Ray's 1e-4 grain
    # --actor.lora.refit adapter: the engines serve each version's LoRA adapter, which the
    # token clients name; rank 0 writes them under the run directory (molt_rollout.adapters).
    adapters = adapter_serving(cfg)
    adapter_dir = str((run_dir / "adapters").resolve())

    def start_rollout() -> RolloutService:
        return RolloutService.start(model, cfg.vllm, cfg.router, cfg.refit, str(run_dir / "logs"),
                                    on_gpu, with_refitter=False, placement=bundles,
                                    adapters=adapters, network=network)  # fmt: skip

    def create_runners() -> RunnerActors:
        # They load the agent module meanwhile too, and dial the router once it is up.
        return RunnerActors(cfg.rollout, cfg.train.agent_path, model,
                            cfg.data.apply_chat_template, cfg.vllm.request_timeout_s,
                            cfg.vllm.max_retries, eval_rollout_config(cfg.rollout, cfg.eval),
                            adapters and adapters.name, network.token)  # fmt: skip

    def build_policy() -> ModelGroup:
        return ModelGroup(cfg.actor, cfg.fsdp, "policy", on_gpu, cfg.train.routing_replay, share)

    def build_reference() -> ModelGroup | None:
        if not cfg.ref.enable:
            return None
        ref_cfg = dataclasses.replace(cfg.actor, model_path=cfg.ref.model_path or model,
                                      num_workers=cfg.ref.num_workers)  # fmt: skip
        return ModelGroup(ref_cfg, cfg.fsdp, "reference", on_gpu, colocation=share)

    def build_critic() -> ModelGroup | None:
        if cfg.algo.advantage.estimator != "gae":
            return None
        return ModelGroup(critic_actor_config(cfg, model), cfg.fsdp, "critic", on_gpu,
                          colocation=share)  # fmt: skip

    if bundles is None:
        rollout, runners, policy, reference, critic = start_concurrently(
            start_rollout, create_runners, build_policy, build_reference, build_critic
        )
    else:  # one after the other: vLLM sizes its KV cache from the GPU memory it finds free
        runners = create_runners()
        rollout, policy = start_rollout(), build_policy()
        reference, critic = build_reference(), build_critic()

    # ---- generation: agent runners, the streaming pool -------------------------------------
    runners.connect(rollout.router.url)
    forced = cfg.train.force_on_policy
    pool = RolloutPool(
        source, runners.launch, cfg.rollout,
        max_inflight_groups=cfg.rollout.groups_per_batch * (1 + cfg.train.async_queue_size),
        max_staleness=0 if forced else cfg.train.max_staleness,
        force_on_policy=forced,
        # A group baseline needs at least two samples to compare.
        min_rollouts_per_group=2 if cfg.algo.advantage.estimator in GROUP_ESTIMATORS else 1,
        group_filter=keep_informative_group if cfg.algo.dynamic_filtering_enable else None,
    )  # fmt: skip

    # ---- training: the policy's refit link to the engines -----------------------------------
    policy.init_refit(rollout.engine_urls, rollout.workers_per_engine, cfg.refit, bool(bundles),
                      adapters, adapter_dir, network)  # fmt: skip
    actors = {"policy": policy} if critic is None else {"policy": policy, "critic": critic}
    models = [group for group in (policy, reference, critic) if group is not None]
    kl_ctl = kl_controller(cfg.algo.advantage.kl_coef, cfg.algo.kl.target, cfg.algo.kl.horizon)

    # ---- resume ----------------------------------------------------------------------------
    checkpoints = CheckpointManager(str(run_dir / "checkpoints"), cfg.ckpt.keep_last)
    best = BestTracker(cfg.ckpt.best_metric, cfg.ckpt.best_mode) if cfg.ckpt.best_metric else None
    first_step = 0
    latest = checkpoints.latest() if cfg.ckpt.resume else None
    if latest is not None:
        state = checkpoints.load(latest, actors)
        first_step = state["step"]
        pool.load_state_dict(state["pool"])
        kl_ctl.load_state_dict(state["kl_controller"])
        if best is not None and state.get("best"):
            best.load_state_dict(state["best"])
        print(f"resumed from {latest} at step {first_step}")
    version = first_step  # the weight version is the number of optimizer steps taken
    # The engines continue from exactly the restored weights. Adapter refit: a fresh run's
    # adapter too (B = 0: the base policy), so vLLM's check of the adapters comes before any
    # step and every token of the run comes through the same LoRA path.
    if latest is not None or adapters is not None:
        policy.refit(version)
    else:
        policy.set_engine_version(version)
    runners.tell_version(version)

    logger = MetricsLogger(cfg.logger, str(run_dir), dataclasses.asdict(cfg),
                           first_step if latest is not None else None)  # fmt: skip
    tokenizer = runners.tokenizer
    pause_mode = "keep" if cfg.train.partial_rollout_enable else "wait"
    metrics: dict[str, float] = {}
    saved_step = done_step = first_step

    def save(step: int) -> None:
        nonlocal saved_step
        checkpoints.save(step, actors, {"step": step, "pool": pool.state_dict(),
                                        "kl_controller": kl_ctl.state_dict(),
                                        "best": best and best.state_dict()})  # fmt: skip
        saved_step = step

    def rejoin(version: int) -> dict[str, float]:
        """Engines restarted since the last call (RolloutService.watch) get the policy's
        weights as `version`, in a new weight-transfer group with every engine; {} if none."""

        def rebuild(urls: list[str]) -> dict[str, float]:
            policy.init_refit(urls, rollout.workers_per_engine, cfg.refit, bool(bundles),
                              adapters, adapter_dir, network)  # fmt: skip
            return policy.refit(version, pause_mode)

        return rollout.rejoin(rebuild)

    def refit(version: int) -> dict[str, float]:
        try:
            times = rejoin(version) or policy.refit(version, pause_mode)
        except Exception:  # an engine died under the refit: restarted, it is refit with the rest
            if not (times := rejoin(version)):
                raise
        runners.tell_version(version)  # every engine serves it: no version read per request
        return times

    # One optimizer step over each batch: the training forward gives the old log-probs.
    reuse = reuses_training_forward(cfg)
    pool.start()
    # A dead engine is restarted on the watch's thread (--vllm.restart_on_failure); the pool
    # wakes a waiting trainer to refit it. One that cannot be stops the run within seconds,
    # with its log tail: a waiting pool at once, a step in progress (a refit stuck on the dead
    # engine) too.
    rollout.watch(on_failure=lambda error: (pool.fail(error), stop.fail(error)),
                  on_restart=lambda: pool.interrupt(EngineRestarted()))  # fmt: skip
    try:
        t_start = time.perf_counter()
        for step in range(first_step, cfg.train.num_steps):
            t_step = time.perf_counter()
            while True:  # a signal here stops at once: nothing trained yet
                try:
                    batch = pool.next_batch(version)
                    break
                except EngineRestarted:
                    rejoin(version)
            t_generated = time.perf_counter()

            with stop.critical():  # a signal waits until the step is trained, logged and saved
                if cfg.vllm.enable_sleep_mode:  # the engine's memory is the trainer's meanwhile
                    set_sleeping(
                        rollout.engine_urls, True, pause_mode, cfg.refit.timeout_s, network.token
                    )
                experience = make_experience(batch, version, policy, cfg.algo, kl_ctl.coef,
                                             reference, critic, cfg.train.routing_replay,
                                             cfg.reward, reuse)  # fmt: skip
                t_experience = time.perf_counter()
                train_metrics, old_logprobs = train_on(
                    experience.samples, experience.sample_groups, policy, critic, cfg, reuse
                )
                if reuse:  # the IS metrics of the old log-probs the step itself computed
                    experience.metrics.update(correction_metrics(experience, old_logprobs,
                                                                 cfg.algo))  # fmt: skip
                t_trained = time.perf_counter()
                if cfg.vllm.enable_sleep_mode:
                    # The models' allocators still hold the step's peak: the waking engines need it.
                    for group in models:
                        group.release_memory()
                    set_sleeping(
                        rollout.engine_urls, False, pause_mode, cfg.refit.timeout_s, network.token
                    )

                version += 1
                refit_times = refit(version)
                t_refit = time.perf_counter()
                kl_ctl.update(experience.metrics.get("ref/kl", 0.0), len(experience.rollouts))
                mean_step_s = (t_refit - t_start) / (step + 1 - first_step)  # this run's, so far

                metrics = {
                    **rollout_metrics(experience.rollouts),
                    **batch.metrics,
                    **experience.metrics,
                    **train_metrics,
                    **refit_times,
                    "ref/kl_coef": kl_ctl.coef,
                    "timing/generation": t_generated - t_step,
                    "timing/experience": t_experience - t_generated,
                    "timing/policy_train": t_trained - t_experience,
                    "timing/broadcast": t_refit - t_trained,
                    "timing/step_total": t_refit - t_step,
                    "timing/eta_s": mean_step_s * (cfg.train.num_steps - step - 1),
                    "perf/train_tokens_per_sec": train_metrics.get("train/tokens", 0.0)
                    / max(t_trained - t_experience, 1e-9),
                    "train/weight_version": float(version),
                    "engine/restarts": float(rollout.restarts),
                }
                new_best = False
                if cfg.eval.every_steps and (step + 1) % cfg.eval.every_steps == 0:
                    results = evaluate(eval_rows, runners, cfg)  # of the weights of `version`
                    metrics.update(results)
                    new_best = best is not None and best.update(version, results)
                if best is not None and best.value is not None:
                    metrics.update({"ckpt/best_value": best.value,
                                    "ckpt/best_version": best.version})  # fmt: skip
                logger.log(step + 1, metrics)
                record_trained_prompts(run_dir, step + 1, batch)
                logger.log_samples(step + 1, sample_rows(experience.rollouts, tokenizer,
                                                         cfg.logger.num_sample_rollouts,
                                                         version - 1))  # trained at  # fmt: skip
                done_step = step + 1
                last = done_step == cfg.train.num_steps
                if new_best or last or (cfg.ckpt.every_steps
                                        and done_step % cfg.ckpt.every_steps == 0):  # fmt: skip
                    save(done_step)
                if new_best:  # the weights of `version` are this step's checkpoint
                    checkpoints.promote_best(version, best.record())
        if cfg.ckpt.export_hf:
            policy.export_hf(str(run_dir / "hf_policy"))
    except Exception:
        rollout.engines.check()  # a dead engine is the cause to report (its log tail included)
        raise
    except Stopped:
        if cfg.ckpt.save_on_exit and done_step > saved_step:
            print(f"saving step {done_step} before stopping (--ckpt.save_on_exit)", flush=True)
            save(done_step)
        raise
    finally:
        pool.close()
        paths = logger.close()
        runners.shutdown()
        for group in models:
            group.shutdown()
        rollout.shutdown()
        if bundles is not None:
            ray.util.remove_placement_group(bundles)
        print(format_final_message(paths, str(run_dir / "checkpoints")))
    return metrics


def start_concurrently(start_rollout, *builders) -> tuple:
    """The engines start on a thread while `builders` run here in order (the runners, the
    policy group, the reference and critic groups): they overlap (docs/benchmarks.md,
    start-up). In order, not on threads of their own: two threads importing transformers' and
    AutoModel's stacks at once can see each other's modules half-initialised (CI saw
    `cannot import name '_shard' from 'torch.distributed'`). Returns (rollout, *built); a
    builder may return None (nothing asked for). Whichever fails, the rest is shut down."""
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


def load_prompts(data: DataConfig) -> tuple[PromptSource, list[dict]]:
    """The training prompt stream and the eval rows, every row read and checked."""
    try:
        return PromptSource.from_config(data), load_eval_rows(data)
    except ValueError as error:
        raise StartupError(str(error)) from None


def train_on(samples: list, groups: list[str], policy: ModelGroup, critic: ModelGroup | None,
             cfg: RunConfig, reuse: bool = False) -> tuple[dict, list | None]:  # fmt: skip
    """`--train.epochs_per_batch` passes, each `--train.mini_batches` optimizer steps; the
    metrics of the last step, plus the token count of all of them. `reuse`
    (`reuses_training_forward`: one step): also the old log-probs that step computed, per
    sample (None otherwise)."""
    chunks = _split_by_group(list(zip(samples, groups, strict=True)), groups,
                             cfg.train.mini_batches)  # fmt: skip
    metrics: dict[str, float] = {}
    tokens = 0.0
    old_logprobs = None
    for _ in range(cfg.train.epochs_per_batch):
        for chunk in chunks:
            chunk_samples, chunk_groups = [s for s, _ in chunk], [g for _, g in chunk]
            if reuse:
                metrics, old_logprobs = policy.train_step(chunk_samples, cfg.algo,
                                                          groups=chunk_groups,
                                                          return_logprobs=True)  # fmt: skip
            else:
                metrics = policy.train_step(chunk_samples, cfg.algo, groups=chunk_groups)
            tokens += metrics.get("train/tokens", 0.0)
            if critic is not None:
                critic_metrics = critic.train_step(
                    chunk_samples, cfg.algo, value_clip=cfg.critic.value_clip, groups=chunk_groups
                )
                metrics.update({f"critic/{k}": v for k, v in critic_metrics.items()})
    metrics["train/tokens"] = tokens
    return metrics, old_logprobs


def evaluate(rows: list[dict], runners: RunnerActors, cfg: RunConfig) -> dict[str, float]:
    t0 = time.perf_counter()
    results: list[GroupResult] = run_eval(rows, runners.launch, cfg.eval)
    return {**eval_metrics(results), "timing/eval": time.perf_counter() - t0}


def keep_informative_group(group: GroupResult) -> bool:
    """Dynamic sampling: a group whose samples all scored the same has zero group-relative
    advantage everywhere and teaches nothing; the pool backfills its slot."""
    return len({r.reward if r.score is None else r.score for r in group.rollouts}) > 1


def record_trained_prompts(run_dir: Path, step: int, batch: Batch) -> None:
    """One line per step: which prompts (dataset order index) it trained, for auditing that a
    resumed run trains every prompt exactly once (a step redone after a crash appears twice;
    the later line is the one in the weights)."""
    line = {"step": step, "prompts": [g.task.prompt_index for g in batch.groups]}
    with (run_dir / "trained_prompts.jsonl").open("a") as f:
        f.write(json.dumps(line) + "\n")


def critic_actor_config(cfg: RunConfig, model: str) -> ActorConfig:
    return dataclasses.replace(cfg.actor, model_path=cfg.critic.model_path or model,
                               num_workers=cfg.critic.num_workers, optim=cfg.critic.optim)  # fmt: skip


def start_ray(cfg: RunConfig) -> None:
    if ray.is_initialized():
        return
    if cfg.train.ray_address:
        ray.init(address=cfg.train.ray_address)
    else:
        # "local": a private instance, even where `ray start` left a cluster (or its address
        # file) on this machine, which a bare ray.init would join.
        ray.init(address="local", object_store_memory=512 << 20, include_dashboard=False,
                 log_to_driver=False)  # fmt: skip


def prepare_run_dir(cfg: RunConfig) -> tuple[RunConfig, Path]:
    """The run directory, with the resolved config in config.json (`--config` loads it back)."""
    name = cfg.logger.run_name or time.strftime("run-%Y%m%d-%H%M%S")
    cfg = dataclasses.replace(cfg, logger=dataclasses.replace(cfg.logger, run_name=name))
    run_dir = Path(cfg.train.output_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    return cfg, run_dir


def _split_by_group(samples: list, groups: list[str], parts: int) -> list[list]:
    """`parts` mini-batches of whole prompt groups (samples arrive group by group)."""
    order = list(dict.fromkeys(groups))
    per_part = -(-len(order) // parts)
    part_of = {g: i // per_part for i, g in enumerate(order)}
    chunks: list[list] = [[] for _ in range(parts)]
    for sample, group in zip(samples, groups, strict=True):
        chunks[part_of[group]].append(sample)
    return [c for c in chunks if c]
