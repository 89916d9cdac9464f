"""`molt-train sft`: supervised fine-tuning on chat data, sharing RL's policy actor, packing,
token-mean loss, checkpoints and logging. Only assistant turns are trained: their spans are found
by rendering the conversation with the model's chat template, prefix by prefix."""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field

import ray

from molt_algos import AlgoConfig
from molt_rollout.agents.data import load_rows
from molt_rollout.config import at_least
from molt_train.actor_config import (
    ActorConfig,
    FSDPConfig,
    OptimConfig,
    validate_actor_config,
    validate_actor_devices,
)
from molt_train.checkpoint import CheckpointManager
from molt_train.config import StartupError
from molt_train.logger import (
    LoggerConfig,
    MetricsLogger,
    format_final_message,
    validate_logger_config,
)
from molt_train.model_group import ModelGroup
from molt_train.packing import Sample
from molt_train.quickstart import data_path
from molt_train.run import prepare_run_dir


@dataclass
class SFTDataConfig:
    """Chat conversations (`--data.*`): rows with a list of messages, optionally tools."""

    # Chat datasets (files, saved datasets or hub ids); default: the shipped quickstart chats.
    train_files: list[str] = field(default_factory=lambda: [str(data_path("halves_sft.jsonl"))])
    messages_key: str = "messages"  # the column holding each conversation's messages
    max_len: int = 2048  # longer conversations are cut (their tail is not trained)
    shuffle: bool = True  # a fresh seeded order of the conversations every epoch
    seed: int = 0  # the shuffle's seed


@dataclass
class SFTTrainConfig:
    """The SFT loop (`--train.*`)."""

    epochs: int = 1  # passes over the conversations
    batch_size: int = 16  # conversations per optimizer step
    output_dir: str = "runs"  # the run directory is output_dir/<run name>
    ray_address: str | None = None  # an existing Ray cluster; None starts a local one


@dataclass
class SFTConfig:
    """`molt-train sft`: supervised fine-tuning on chat conversations."""

    actor: ActorConfig = field(default_factory=lambda: ActorConfig(optim=OptimConfig(lr=1e-3)))
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


# The negative log-likelihood of the trained tokens, averaged over all of them.
SFT_LOSS = AlgoConfig(aggregation="token-mean")


def validate_sft_config(cfg: SFTConfig, gpus: int | None = None) -> None:
    """StartupError naming the flag of a setting that cannot work; `gpus` once Ray knows them."""
    try:
        if not cfg.data.train_files:
            raise ValueError("--data.train_files: give at least one chat dataset")
        at_least("train", cfg.train, ("epochs", "batch_size"), 1)
        at_least("data", cfg.data, ("max_len",), 2)
        validate_actor_config(cfg.actor, cfg.fsdp)
        validate_logger_config(cfg.logger)
        if gpus is not None:
            validate_actor_devices(cfg.actor, cfg.fsdp, gpus)
    except ValueError as error:
        raise StartupError(str(error)) from None


def assistant_sample(
    tokenizer, messages: list[dict], tools: list[dict] | None, max_len: int
) -> Sample:
    """Token ids and a mask of the assistant turns: turn i spans from the end of `messages[:i]`
    with the generation prompt to the end of `messages[:i+1]` (a template must not rewrite it)."""

    def render(part: list[dict], prompt: bool) -> list[int]:
        options = dict(tools=tools, tokenize=True, add_generation_prompt=prompt, return_dict=False)
        return list(tokenizer.apply_chat_template(part, **options))

    ids = render(messages, False)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, turn = len(render(messages[:i], True)), render(messages[: i + 1], False)
        if turn != ids[: len(turn)]:
            raise ValueError(
                f"the chat template renders turn {i} differently inside the full conversation; "
                "its assistant tokens cannot be located"
            )
        mask[start : len(turn)] = [1] * (len(turn) - start)
    return Sample(token_ids=ids[:max_len], loss_mask=mask[:max_len])


def train_sft(cfg: SFTConfig) -> dict[str, float]:
    from transformers import AutoTokenizer

    validate_sft_config(cfg)
    if not ray.is_initialized():  # no --train.ray_address: a private instance
        ray.init(
            address=cfg.train.ray_address or "local", include_dashboard=False, log_to_driver=False
        )
    gpus = int(ray.cluster_resources().get("GPU", 0))
    validate_sft_config(cfg, gpus)
    cfg, run_dir = prepare_run_dir(cfg, "sft")
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor.model_path)
    data = cfg.data
    rows = [row for f in data.train_files for row in load_rows(f, prompt_key=data.messages_key)]
    samples = [assistant_sample(tokenizer, r["prompt"], r.get("tools"), data.max_len) for r in rows]
    samples = [s for s in samples if any(s.loss_mask)]
    policy = ModelGroup(cfg.actor, cfg.fsdp, "policy", gpus > 0)
    logger = MetricsLogger(cfg.logger, str(run_dir), dataclasses.asdict(cfg))
    rng, step, metrics = random.Random(data.seed), 0, {}
    try:
        for _ in range(cfg.train.epochs):
            order = list(range(len(samples)))
            if data.shuffle:
                rng.shuffle(order)
            for first in range(0, len(order), cfg.train.batch_size):
                batch = [samples[i] for i in order[first : first + cfg.train.batch_size]]
                t0 = time.perf_counter()
                metrics = policy.train_step(batch, SFT_LOSS, sft=True)
                metrics["timing/step_total"] = time.perf_counter() - t0
                step += 1
                logger.log(step, metrics)
        checkpoints = CheckpointManager(str(run_dir / "checkpoints"), keep_last=1)
        checkpoints.save(step, {"policy": policy}, {"step": step})
        policy.export_hf(str(run_dir / "hf_policy"))
    finally:
        paths = logger.close()
        policy.shutdown()
    print(format_final_message(paths, str(run_dir / "checkpoints")))
    return metrics
