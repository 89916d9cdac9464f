"""The RL loop. `train(cfg)` checks the config, the agent module and the data before Ray starts,
starts the run (molt_train.run); then every step takes a batch from the pool, makes experience,
trains, pushes the weights to the engines and logs, evaluating and checkpointing on their
cadence. The weight version is the optimizer step count; SIGTERM and SIGINT stop the loop at the
next safe point (molt_train.signals)."""

from __future__ import annotations

import json
import time

import ray

from molt_rollout.agents.data import PromptSource, load_eval_rows
from molt_rollout.agents.eval import eval_metrics, run_eval
from molt_rollout.agents.pool import Batch
from molt_rollout.engines import lifeline
from molt_rollout.engines.service import EngineRestarted
from molt_train.config import RunConfig, StartupError, resolved
from molt_train.experience import Experience, correction_metrics, make_experience
from molt_train.metrics import rollout_metrics, sample_rows
from molt_train.run import Run
from molt_train.signals import GracefulStop, Stopped
from molt_train.validate import validate_agent, validate_run_config


def train(cfg: RunConfig) -> dict[str, float]:
    validate_run_config(cfg)
    cfg = resolved(cfg)
    try:  # a broken agent module or data file fails here, in the driver, naming it
        validate_agent(cfg)
        source, eval_rows = PromptSource.from_config(cfg.data), load_eval_rows(cfg.data)
    except ValueError as error:
        raise StartupError(str(error)) from None
    lifeline.reap_descendants()  # a SIGKILLed driver leaves no process of the run behind
    # ray.init installs its own SIGTERM handler (sys.exit): ours comes after. Without
    # --train.ray_address a private instance ("local"), even where `ray start` left a cluster
    # (or its address file) on this machine, which a bare ray.init would join.
    if cfg.train.ray_address and not ray.is_initialized():
        ray.init(address=cfg.train.ray_address)
    elif not ray.is_initialized():
        ray.init(
            address="local",
            object_store_memory=512 << 20,
            include_dashboard=False,
            log_to_driver=False,
        )
    with GracefulStop() as stop:
        run = Run(cfg, stop, source, eval_rows)
        try:
            return train_steps(run)
        finally:
            run.close()


def train_steps(run: Run) -> dict[str, float]:
    cfg, metrics = run.cfg, {}
    saved_step = done_step = run.first_step
    t_start = time.perf_counter()
    try:
        for step in range(run.first_step, cfg.train.num_steps):
            t_step = time.perf_counter()
            batch = next_batch(run, step)  # a signal here stops at once: nothing trained yet
            with run.stop.critical():  # a signal waits until the step is trained, logged, saved
                metrics, experience = train_step(run, step, batch, t_step)
                done_step = version = step + 1
                per_step = (time.perf_counter() - t_start) / (version - run.first_step)
                metrics["timing/eta_s"] = per_step * (cfg.train.num_steps - version)
                results, new_best = evaluate(run, version)
                metrics |= results
                log_step(run, version, batch, experience, metrics)
                cadence = cfg.ckpt.every_steps and version % cfg.ckpt.every_steps == 0
                if new_best or cadence or version == cfg.train.num_steps:
                    saved_step = run.save(version)
                if new_best:  # the weights of `version` are this step's checkpoint
                    run.checkpoints.promote_best(version, run.best.state_dict())
        if cfg.ckpt.export_hf:
            run.policy.export_hf(str(run.run_dir / "hf_policy"))
    except Exception:
        run.rollout.engines.check()  # a dead engine is the cause to report (its log tail too)
        raise
    except Stopped:
        if cfg.ckpt.save_on_exit and done_step > saved_step:
            print(f"saving step {done_step} before stopping (--ckpt.save_on_exit)", flush=True)
            run.save(done_step)
        raise
    return metrics


def train_step(run: Run, step: int, batch: Batch, t_step: float) -> tuple[dict, Experience]:
    """One batch at weight version `step`: experience, optimizer steps, new weights to the engines."""
    cfg, kl_ctl = run.cfg, run.kl_ctl
    t_generated = time.perf_counter()
    with run.weights.asleep():
        experience = make_experience(
            batch, step, cfg, kl_ctl.coef, run.policy, run.reference, run.critic, run.reuse
        )
        t_experience = time.perf_counter()
        train_metrics = train_on(run, experience)
        t_trained = time.perf_counter()
    refit_times = run.weights.push(step + 1)
    t_refit, train_s = time.perf_counter(), t_trained - t_experience
    kl_ctl.update(experience.metrics.get("ref/kl", 0.0), len(experience.rollouts))
    metrics = rollout_metrics(experience.rollouts) | batch.metrics | experience.metrics
    return metrics | train_metrics | refit_times | {
        "ref/kl_coef": kl_ctl.coef,
        "timing/generation": t_generated - t_step,
        "timing/experience": t_experience - t_generated,
        "timing/policy_train": train_s,
        "timing/broadcast": t_refit - t_trained,
        "timing/step_total": t_refit - t_step,
        "perf/train_tokens_per_sec": train_metrics["train/tokens"] / max(train_s, 1e-9),
        "train/weight_version": float(step + 1),
        "engine/restarts": float(run.rollout.restarts),
    }, experience


def next_batch(run: Run, version: int) -> Batch:
    """The pool's next batch; an engine restarted meanwhile (the pool wakes us) rejoins first."""
    while True:
        try:
            return run.pool.next_batch(version)
        except EngineRestarted:
            run.weights.rejoin(version)


def train_on(run: Run, experience: Experience) -> dict[str, float]:
    """`--train.epochs_per_batch` passes of `--train.mini_batches` optimizer steps: the last
    step's metrics and the token count of all; with `run.reuse` the IS metrics too."""
    cfg, policy, critic = run.cfg, run.policy, run.critic
    metrics, tokens, old_logprobs = {}, 0.0, None
    for _ in range(cfg.train.epochs_per_batch):
        for samples, groups in mini_batches(experience, cfg.train.mini_batches):
            result = policy.train_step(samples, cfg.algo, groups=groups, return_logprobs=run.reuse)
            metrics, old_logprobs = result if run.reuse else (result, None)
            tokens += metrics.get("train/tokens", 0.0)
            if critic is not None:
                values = critic.train_step(
                    samples, cfg.algo, value_clip=cfg.critic.value_clip, groups=groups
                )
                metrics |= {f"critic/{k}": v for k, v in values.items()}
    if run.reuse:
        experience.metrics |= correction_metrics(experience, old_logprobs, cfg.algo)
    return metrics | {"train/tokens": tokens}


def mini_batches(experience: Experience, parts: int) -> list[tuple[list, list[str]]]:
    """`parts` mini-batches of whole prompt groups: (samples, their group ids) each."""
    order = list(dict.fromkeys(experience.sample_groups))
    per_part = -(-len(order) // parts)
    part_of = {group: i // per_part for i, group in enumerate(order)}
    chunks = [([], []) for _ in range(parts)]
    for sample, group in zip(experience.samples, experience.sample_groups, strict=True):
        chunks[part_of[group]][0].append(sample)
        chunks[part_of[group]][1].append(group)
    return [chunk for chunk in chunks if chunk[0]]


def evaluate(run: Run, version: int) -> tuple[dict[str, float], bool]:
    """On `--eval.every_steps`' cadence, the eval metrics of `version`, and whether the best."""
    metrics, new_best, best = {}, False, run.best
    if run.cfg.eval.every_steps and version % run.cfg.eval.every_steps == 0:
        t0 = time.perf_counter()
        metrics = eval_metrics(run_eval(run.eval_rows, run.runners.launch, run.cfg.eval))
        metrics["timing/eval"] = time.perf_counter() - t0
        new_best = best is not None and best.update(version, metrics)
    if best is not None and best.value is not None:
        metrics |= {"ckpt/best_value": best.value, "ckpt/best_version": best.version}
    return metrics, new_best


def log_step(run: Run, step: int, batch: Batch, experience: Experience, metrics: dict) -> None:
    """The step's metrics, a few of its rollouts decoded, and which prompts it trained (a step
    redone after a crash appears twice in trained_prompts.jsonl; the later line counts)."""
    run.logger.log(step, metrics)
    line = {"step": step, "prompts": [group.task.prompt_index for group in batch.groups]}
    with (run.run_dir / "trained_prompts.jsonl").open("a") as f:
        f.write(json.dumps(line) + "\n")
    # Sampled at weight version step - 1 at the latest.
    rows = sample_rows(
        experience.rollouts, run.runners.tokenizer, run.cfg.logger.num_sample_rollouts, step - 1
    )
    run.logger.log_samples(step, rows)
