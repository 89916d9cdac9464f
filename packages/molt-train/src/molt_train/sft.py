"""`molt-train sft`: supervised fine-tuning on chat data, on the same policy actor as RL.

RL recipes start from SFT checkpoints, so SFT shares the actor, packing, the global token-mean
loss, checkpoints and logging. Only assistant turns are trained: their token spans are found by
rendering the conversation with the model's own chat template, prefix by prefix.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from molt_rollout.data import load_rows
from molt_rollout.tiny_model import build_tiny_model
from molt_train.actor_config import (
    ActorConfig,
    FSDPConfig,
    OptimConfig,
    validate_actor_config,
    validate_actor_devices,
)
from molt_train.checkpoint import CheckpointManager
from molt_train.config import AlgoConfig
from molt_train.logger import (
    LoggerConfig,
    MetricsLogger,
    format_final_message,
    validate_logger_config,
)
from molt_train.model_group import ModelGroup
from molt_train.packing import Sample
from molt_train.quickstart import data_path


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


def validate_sft_config(cfg: SFTConfig) -> None:
    if not cfg.data.train_files:
        raise ValueError("--data.train_files: give at least one chat dataset")
    if cfg.train.epochs < 1 or cfg.train.batch_size < 1:
        raise ValueError("--train.epochs and --train.batch_size must be >= 1")
    if cfg.data.max_len < 2:
        raise ValueError("--data.max_len must be >= 2")
    validate_actor_config(cfg.actor, cfg.fsdp)
    validate_logger_config(cfg.logger)


def assistant_sample(tokenizer, messages: list[dict], tools: list[dict] | None,
                     max_len: int) -> Sample:  # fmt: skip
    """Token ids of the whole conversation and a mask of its assistant turns.

    Each assistant turn i spans from the end of `messages[:i]` rendered with the generation
    prompt (what the model sees before it answers) to the end of `messages[:i+1]`. This needs
    a template whose renders of a conversation's prefixes are prefixes of its full render; one
    that rewrites history (e.g. drops earlier reasoning) is refused, naming the turn."""

    def render(part: list[dict], generation_prompt: bool) -> list[int]:
        return list(tokenizer.apply_chat_template(
            part, tools=tools, tokenize=True, add_generation_prompt=generation_prompt,
            return_dict=False,
        ))  # fmt: skip

    ids = render(messages, False)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = len(render(messages[:i], True)), len(render(messages[: i + 1], False))
        if render(messages[: i + 1], False) != ids[:end]:
            raise ValueError(
                f"the chat template renders turn {i} differently inside the full conversation; "
                "its assistant tokens cannot be located"
            )
        mask[start:end] = [1] * (end - start)
    return Sample(token_ids=ids[:max_len], loss_mask=mask[:max_len])


def train_sft(cfg: SFTConfig) -> dict[str, float]:
    """Epochs over the conversations in batches; returns the last step's metrics."""
    from transformers import AutoTokenizer

    if not ray.is_initialized():
        ray.init(address=cfg.train.ray_address or "local",  # None: a private instance
                 include_dashboard=False, log_to_driver=False)  # fmt: skip
    gpus = int(ray.cluster_resources().get("GPU", 0))
    validate_actor_devices(cfg.actor, cfg.fsdp, gpus)
    on_gpu = gpus > 0
    model = cfg.actor.model_path or str(build_tiny_model())
    cfg = dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, model_path=model))
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor.model_path)
    rows = [
        row for f in cfg.data.train_files for row in load_rows(f, prompt_key=cfg.data.messages_key)
    ]
    samples = [assistant_sample(tokenizer, r["prompt"], r.get("tools"), cfg.data.max_len)
               for r in rows]  # fmt: skip
    samples = [s for s in samples if any(s.loss_mask)]

    run_dir = Path(cfg.train.output_dir) / (
        cfg.logger.run_name or time.strftime("sft-%Y%m%d-%H%M%S")
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    actor = ModelGroup(cfg.actor, cfg.fsdp, "policy", on_gpu)
    logger = MetricsLogger(cfg.logger, str(run_dir), dataclasses.asdict(cfg))
    rng = random.Random(cfg.data.seed)
    step, metrics = 0, {}
    try:
        for _ in range(cfg.train.epochs):
            order = list(range(len(samples)))
            if cfg.data.shuffle:
                rng.shuffle(order)
            for first in range(0, len(order), cfg.train.batch_size):
                batch = [samples[i] for i in order[first : first + cfg.train.batch_size]]
                t0 = time.perf_counter()
                metrics = actor.train_step(batch, SFT_LOSS, sft=True)
                metrics["timing/step_total"] = time.perf_counter() - t0
                step += 1
                logger.log(step, metrics)
        checkpoints = CheckpointManager(str(run_dir / "checkpoints"), keep_last=1)
        checkpoints.save(step, {"policy": actor}, {"step": step})
        actor.export_hf(str(run_dir / "hf_policy"))
    finally:
        paths = logger.close()
        actor.shutdown()
    print(format_final_message(paths, str(run_dir / "checkpoints")))
    return metrics
