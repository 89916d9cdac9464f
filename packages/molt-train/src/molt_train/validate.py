"""The start-up checks of a run's settings, one function per concern: each names the flags of a
combination that cannot work, before Ray starts (the device checks once it has)."""

from __future__ import annotations

from molt_algos import (
    estimator_needs,
    validate_advantage_config,
    validate_is_correction,
    validate_loss_config,
    validate_reward_config,
)
from molt_rollout import ChatRunner, load_agent, validate_rollout_config
from molt_rollout.agents.data import validate_data_config
from molt_rollout.agents.eval import validate_eval_config
from molt_rollout.config import at_least, validate_engine_devices
from molt_train.actor_config import validate_actor_config, validate_actor_devices, validate_ranks
from molt_train.config import (
    RunConfig,
    StartupError,
    model_configs,
    resolved_reward,
    response_budget,
    trained_staleness,
)
from molt_train.logger import validate_logger_config

# vLLM's LoRA flags, which --actor.lora.refit adapter sets from the trained adapters' settings.
ENGINE_LORA_FLAGS = {"--enable-lora", "--max-lora-rank", "--max-loras", "--max-cpu-loras"}
ENGINE_LORA_FLAGS |= {"--lora-modules", "--lora-target-modules"}


def validate_run_config(cfg: RunConfig, cluster_gpus: int | None = None) -> None:
    """Raise StartupError naming the flags of any combination that cannot work. `cluster_gpus`:
    the Ray cluster's GPUs (0 on CPU); None (before Ray starts) leaves out the device checks."""
    try:
        validate_algo(cfg)
        validate_reward(cfg)
        validate_steps(cfg)
        validate_score_centering(cfg)
        validate_actor_config(cfg.actor, cfg.fsdp)
        validate_rollout_config(cfg.rollout, cfg.vllm, cfg.router, cfg.refit)
        validate_data_config(cfg.data)
        validate_eval_config(cfg.eval)
        validate_logger_config(cfg.logger)
        validate_checkpoints(cfg)
        validate_colocation(cfg)
        validate_adapter_refit(cfg)
        validate_model_ranks(cfg)
        if cluster_gpus is not None:
            validate_devices(cfg, cluster_gpus)
    except ValueError as error:
        raise StartupError(str(error)) from None


def validate_algo(cfg: RunConfig) -> None:
    algo, adv, n = cfg.algo, cfg.algo.advantage, cfg.rollout.n_samples_per_prompt
    needs = estimator_needs(adv.estimator)
    validate_advantage_config(adv)
    validate_is_correction(adv)
    validate_loss_config(algo.policy_loss, algo.loss)
    if needs.groups and n < 2:
        raise ValueError(
            f"--algo.advantage.estimator {adv.estimator} compares the samples of a prompt: "
            f"--rollout.n_samples_per_prompt must be >= 2, got {n}"
        )
    if (adv.kl_coef > 0 or algo.kl.loss_coef > 0) and not cfg.ref.enable:
        raise ValueError("--algo.advantage.kl_coef / --algo.kl.loss_coef: add --ref.enable")
    if needs.reference and not cfg.ref.enable:
        raise ValueError(
            f"--algo.advantage.estimator {adv.estimator} learns from the reference model: add "
            "--ref.enable --ref.model_path TEACHER"
        )
    if algo.kl.target is not None and not needs.kl_reward:
        raise ValueError(
            f"--algo.kl.target adapts the reward's KL coefficient, which "
            f"--algo.advantage.estimator {adv.estimator} does not use"
        )
    if algo.kl.target is not None and (algo.kl.target <= 0 or algo.kl.horizon <= 0):
        raise ValueError("--algo.kl.target and --algo.kl.horizon must be > 0")
    if adv.is_correction_level != "off" and cfg.rollout.top_p < 1.0:
        raise ValueError(
            f"--algo.advantage.is_correction_level {adv.is_correction_level} with --rollout.top_p "
            f"{cfg.rollout.top_p}: the trainer cannot renormalise over the nucleus as the engine "
            "does, so the IS ratio would be biased; use --rollout.top_p 1.0"
        )


def validate_score_centering(cfg: RunConfig) -> None:
    """It reads the engine's top-k candidates and whole rows' hidden states."""
    level = cfg.algo.advantage.is_correction_level
    if not cfg.algo.score_centering:
        return
    if cfg.rollout.top_logprobs < 1:
        raise ValueError("--algo.score_centering needs the sampler's top-k: --rollout.top_logprobs")
    if level in ("seq", "geo"):
        raise ValueError(
            f"--algo.score_centering corrects per token: --algo.advantage.is_correction_level "
            f"{level} does not compose with it; use token or off"
        )
    if max(cfg.fsdp.tp_size, cfg.fsdp.ep_size, cfg.fsdp.cp_size) > 1:  # it reads whole rows
        raise ValueError(
            "--algo.score_centering: use 1 for --fsdp.tp_size, --fsdp.ep_size and --fsdp.cp_size"
        )


def validate_reward(cfg: RunConfig) -> None:
    if cfg.reward.overlong_buffer_len > 0 and response_budget(cfg) is None:
        raise ValueError(
            f"--reward.overlong_buffer_len {cfg.reward.overlong_buffer_len} needs a budget: set "
            "--reward.max_response_len, --rollout.max_response_tokens or --rollout.max_tokens"
        )
    try:
        validate_reward_config(resolved_reward(cfg))
    except ValueError as error:
        raise ValueError(f"--reward.*: {error}") from None


def validate_steps(cfg: RunConfig) -> None:
    train, groups = cfg.train, cfg.rollout.groups_per_batch
    at_least("train", train, ("num_steps", "epochs_per_batch", "mini_batches"), 1)
    at_least("train", train, ("async_queue_size", "max_staleness"), 0)
    if groups % train.mini_batches:
        raise ValueError(
            f"--rollout.groups_per_batch {groups} does not divide into --train.mini_batches "
            f"{train.mini_batches}"
        )
    several_steps = train.epochs_per_batch > 1 or train.mini_batches > 1
    if train.force_on_policy and several_steps:
        raise ValueError(
            "--train.force_on_policy with --train.epochs_per_batch or --train.mini_batches > 1: "
            "after a batch's first step its tokens are off-policy; use 1 for both"
        )
    off_policy = several_steps or not train.force_on_policy
    if off_policy and cfg.algo.advantage.is_correction_level == "off":
        raise ValueError(
            "--algo.advantage.is_correction_level off with tokens sampled by older weights "
            f"(--train.force_on_policy False, --train.async_queue_size {train.async_queue_size}): "
            "set --algo.advantage.is_correction_level token|seq|geo, or --train.force_on_policy"
        )
    if train.routing_replay and cfg.fsdp.cp_size > 1:
        raise ValueError(
            "--train.routing_replay with --fsdp.cp_size > 1: replay runs on native MoE layers, "
            "which do not split rows into context-parallel windows"
        )
    if train.routing_replay and not cfg.vllm.enable_return_routed_experts:
        raise ValueError("--train.routing_replay: add --vllm.enable_return_routed_experts")


def validate_checkpoints(cfg: RunConfig) -> None:
    ckpt = cfg.ckpt
    at_least("ckpt", ckpt, ("keep_last",), 1)
    at_least("ckpt", ckpt, ("every_steps",), 0)
    if ckpt.best_metric is not None and not ckpt.best_metric.startswith("eval/"):
        raise ValueError(
            f"--ckpt.best_metric {ckpt.best_metric!r}: the best checkpoint is chosen by an eval "
            "metric, e.g. eval/pass@1 or eval/<data source>/pass@1"
        )
    if ckpt.best_metric is not None and not cfg.eval.every_steps:
        raise ValueError(f"--ckpt.best_metric {ckpt.best_metric}: set --eval.every_steps")


def validate_colocation(cfg: RunConfig) -> None:
    """--train.colocate: the engines on the GPU of the trainer's rank 0, refit over CUDA IPC."""
    vllm, backend, colocate = cfg.vllm, cfg.refit.backend, cfg.train.colocate
    if not colocate and backend == "molt_ipc":
        raise ValueError("--refit.backend molt_ipc serves a colocated engine: add --train.colocate")
    if not colocate and vllm.enable_sleep_mode:
        raise ValueError("--vllm.enable_sleep_mode lends the engine's memory: add --train.colocate")
    if colocate and vllm.enable_sleep_mode and cfg.train.partial_rollout_enable:
        raise ValueError(
            "--vllm.enable_sleep_mode drops the KV cache of requests kept across the training "
            "step: add --train.partial_rollout_enable False"
        )
    if colocate and (vllm.ray_resources or cfg.actor.ray_resources):
        raise ValueError(
            "--train.colocate places engine and trainer in shared GPU bundles: "
            "--vllm.ray_resources and --actor.ray_resources do not apply"
        )
    if colocate and backend not in ("auto", "molt_ipc"):
        raise ValueError(f"--train.colocate refits over CUDA IPC, not --refit.backend {backend}")
    one_gpu = vllm.tensor_parallel_size * vllm.data_parallel_size == 1
    if colocate and (vllm.num_engines != vllm.engines_per_gpu or not one_gpu):
        raise ValueError(
            "--train.colocate runs the engines on the GPU of the trainer's rank 0: use "
            "--vllm.num_engines equal to --vllm.engines_per_gpu (1, or 2 for a small model), "
            "--vllm.tensor_parallel_size 1, --vllm.data_parallel_size 1"
        )


def validate_adapter_refit(cfg: RunConfig) -> None:
    """--actor.lora.refit adapter: the engines serve the trained adapters as they are."""
    if cfg.actor.lora.refit != "adapter":
        return
    given = [a for a in cfg.vllm.extra_args if a.split("=")[0] in ENGINE_LORA_FLAGS]
    if given:
        raise ValueError(
            f"--vllm.extra_args {given[0]} with --actor.lora.refit adapter: the engines' LoRA "
            "settings follow the trained adapters"
        )
    if trained_staleness(cfg) is None:
        raise ValueError(
            "--actor.lora.refit adapter with --train.max_staleness None: the engines would keep "
            "every version's adapter; set --train.max_staleness"
        )
    if cfg.refit.report_unupdated:
        raise ValueError("--refit.report_unupdated: no weights change under --actor.lora.refit")
    if cfg.vllm.enable_sleep_mode:
        raise ValueError(
            "--vllm.enable_sleep_mode with --actor.lora.refit adapter: that vLLM keeps the "
            "adapters through sleep is unchecked; use --actor.lora.refit merged"
        )


def validate_model_ranks(cfg: RunConfig) -> None:
    """Every model is parallelised by the same `--fsdp.*` sizes, as the actor's are."""
    flags = {"reference": "--ref.num_workers", "critic": "--critic.num_workers"}
    for role, model in list(model_configs(cfg).items())[1:]:
        validate_ranks(model.num_workers, cfg.fsdp, flags[role])


def validate_devices(cfg: RunConfig, cluster_gpus: int) -> None:
    """What depends on the cluster's GPUs (0 on CPU): checked once Ray knows them."""
    ranks, vllm = [model.num_workers for model in model_configs(cfg).values()], cfg.vllm
    engines = vllm.num_engines * vllm.tensor_parallel_size * vllm.data_parallel_size
    # Colocated models and engines share bundles; otherwise every rank has a GPU of its own.
    wanted = max(ranks) if cfg.train.colocate else sum(ranks) + engines // vllm.engines_per_gpu
    if cfg.train.colocate and not cluster_gpus:
        raise ValueError("--train.colocate shares GPUs, but the Ray cluster has none")
    if cluster_gpus and wanted > cluster_gpus:
        raise ValueError(
            f"the run asks for {wanted} GPUs (--actor.num_workers, --ref.num_workers, "
            "--critic.num_workers, --vllm.num_engines x tensor_parallel_size x "
            f"data_parallel_size / --vllm.engines_per_gpu) but the Ray cluster has {cluster_gpus}"
        )
    validate_actor_devices(cfg.actor, cfg.fsdp, cluster_gpus)
    validate_engine_devices(cfg.vllm, cluster_gpus > 0)


def validate_agent(cfg: RunConfig) -> None:
    """Import the agent module (its error says what is wrong); check it against the data flags."""
    runner = load_agent(cfg.train.agent_path)
    if issubclass(runner, ChatRunner) and not cfg.data.apply_chat_template:
        raise ValueError(
            f"--data.apply_chat_template False with the ChatAgent of {cfg.train.agent_path}: "
            "its messages are rendered with the chat template; string prompts need an Env"
        )
