"""The actor's configuration (`--actor.*`, `--fsdp.*`), its checks, its learning-rate schedule."""

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ROUTER_MARKER = "mlp.gate."  # Qwen3-MoE router weights: model.layers.N.mlp.gate.weight


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule (`--actor.optim.*`, `--critic.optim.*`)."""

    lr: float = 1e-6  # AdamW learning rate (peak, after warmup)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW moment decays
    eps: float = 1e-8  # AdamW denominator epsilon
    warmup_steps: int = 0  # linear warmup from 0 to lr
    # The lr after warmup: constant, or a linear or cosine decay to min_lr at total_steps.
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    min_lr: float = 0.0  # the floor of linear/cosine decay
    total_steps: int | None = None  # decay horizon; required for linear/cosine
    max_grad_norm: float = 1.0  # clip the global gradient norm to this


@dataclass
class FSDPConfig:
    """How every model is sharded and parallelised (`--fsdp.*`; AutoModel's FSDP2)."""

    tp_size: int = 1  # tensor parallel ranks (GPU; AutoModel)
    # context parallel ranks: each runs 1/cp_size of every packed row (molt_train.context_parallel)
    cp_size: int = 1
    ep_size: int = 1  # expert parallel ranks for MoE models (GPU; AutoModel)
    offload: Literal["none", "optimizer"] = "none"  # optimizer: Adam states, fp32 params on host
    reshard_after_forward: bool = True  # ZeRO-3; False keeps layers gathered (ZeRO-2-like)


@dataclass
class LoRAConfig:
    """Low-rank adapters on the policy (`--actor.lora.*`; molt_train.lora)."""

    rank: int = 0  # adapter rank r; 0 = no LoRA (every weight trains)
    alpha: float = 32.0  # scale = alpha / rank
    # Linear layers to adapt: full module names or AutoModel wildcards (* matches any text).
    target_modules: list[str] = field(default_factory=lambda: ["*_proj"])
    # How RL engines get the policy: merged = W + (alpha / rank) B A under W's name, through
    # the weight-transfer protocol; adapter = A and B alone, served by vLLM's LoRA support:
    # a smaller refit, slower decoding (docs/concepts/refit.md).
    refit: Literal["merged", "adapter"] = "merged"


@dataclass
class ActorConfig:
    """The policy model and its ranks (`--actor.*`); the reference and critic copy it."""

    model_path: str = ""  # HF dir or hub id; "" = the embedded tiny model
    num_workers: int = 1  # ranks (one per GPU; CPU processes on CPU; a tiny model: keep 1)
    max_tokens_per_microbatch: int = 8192  # packing budget per microbatch
    gradient_checkpointing: bool = False  # activation checkpointing of decoder layers
    logprob_chunk_size: int = 1024  # tokens per block of molt_algos' chunked log-probs
    dtype: Literal["bf16", "fp32"] = "bf16"  # GPU compute dtype (fp32 master weights); CPU: fp32
    optim: OptimConfig = field(default_factory=OptimConfig)
    freeze_moe_router: bool = False  # do not train MoE router weights
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    seed: int = 0  # base seed; each rank adds its rank
    # Custom Ray resources each rank asks for, e.g. {"trainer_node": 1}: ranks go to the nodes
    # started with them (`ray start --resources`); {}: wherever Ray places them.
    ray_resources: dict[str, float] = field(default_factory=dict)


def validate_actor_config(actor: ActorConfig, fsdp: FSDPConfig) -> None:
    """ValueError naming the flags of a bad combination, before Ray starts."""
    optim = actor.optim
    validate_ranks(actor.num_workers, fsdp, "--actor.num_workers")
    if any(amount <= 0 for amount in actor.ray_resources.values()):
        raise ValueError(f"--actor.ray_resources amounts must be > 0, got {actor.ray_resources}")
    if fsdp.cp_size > 1 and (fsdp.tp_size > 1 or fsdp.ep_size > 1):
        raise ValueError(
            "--fsdp.cp_size > 1 is not combined with --fsdp.tp_size or ep_size > 1 yet"
        )
    if actor.max_tokens_per_microbatch < 1 or actor.logprob_chunk_size < 1:
        raise ValueError("--actor.max_tokens_per_microbatch and --actor.logprob_chunk_size >= 1")
    if not optim.lr > 0 or not 0 <= optim.min_lr <= optim.lr:
        raise ValueError("--actor.optim.lr must be > 0 and --actor.optim.min_lr in [0, lr]")
    if optim.warmup_steps < 0 or optim.max_grad_norm <= 0:
        raise ValueError("--actor.optim.warmup_steps >= 0 and --actor.optim.max_grad_norm > 0")
    if optim.schedule != "constant" and optim.total_steps is None:
        raise ValueError(f"--actor.optim.schedule {optim.schedule} needs --actor.optim.total_steps")
    if optim.total_steps is not None and optim.total_steps <= optim.warmup_steps:
        raise ValueError("--actor.optim.total_steps must exceed --actor.optim.warmup_steps")
    validate_lora_config(actor.lora)


def validate_ranks(n: int, fsdp: FSDPConfig, flag: str) -> None:
    """A model's ranks (`flag`: its num_workers) split by the `--fsdp.*` sizes."""
    if n < 1:
        raise ValueError(f"{flag} must be >= 1, got {n}")
    for name in ("tp_size", "cp_size", "ep_size"):
        size = getattr(fsdp, name)
        if size < 1 or n % size:
            raise ValueError(f"--fsdp.{name} {size} must be >= 1, dividing {flag} {n}")
    if n % (fsdp.tp_size * fsdp.cp_size):
        raise ValueError(f"--fsdp.tp_size * --fsdp.cp_size must divide {flag} {n}")
    if (n // fsdp.tp_size) % fsdp.ep_size:
        raise ValueError(f"--fsdp.ep_size must divide {flag} / --fsdp.tp_size")


def validate_lora_config(lora: LoRAConfig) -> None:
    """LoRA settings wrong on any model, or that would serve another policy than trained."""
    # Imported here: ModelWorker imports this module and runs without Ray or vLLM (torchrun).
    from molt_rollout.refit.adapters import MAX_ENGINE_LORA_RANK

    if lora.rank < 0:
        raise ValueError(f"--actor.lora.rank must be >= 0 (0: no LoRA), got {lora.rank}")
    if lora.refit == "adapter" and not lora.rank:
        raise ValueError("--actor.lora.refit adapter serves LoRA adapters: set --actor.lora.rank")
    if not lora.rank:
        return
    if lora.refit == "adapter" and lora.rank > MAX_ENGINE_LORA_RANK:
        raise ValueError(
            f"--actor.lora.refit adapter with --actor.lora.rank {lora.rank}: vLLM serves "
            f"adapters up to rank {MAX_ENGINE_LORA_RANK} (its largest --max-lora-rank); use "
            "--actor.lora.refit merged"
        )
    if not lora.alpha > 0:
        raise ValueError(f"--actor.lora.alpha must be > 0, got {lora.alpha}")
    if not lora.target_modules or not all(lora.target_modules):
        raise ValueError("--actor.lora.target_modules needs at least one non-empty module name")
    from nemo_automodel.components._peft.module_matcher import wildcard_match

    # AutoModel's matcher: a pattern equals the module's name or matches it with wildcards.
    if any(p == "lm_head" or wildcard_match(p, "lm_head") for p in lora.target_modules):
        # The trainer's log-probs read the LM head's weight directly (molt_train.token_stats),
        # so an adapter there would train nothing, yet its merged weight would be served; with
        # tied embeddings the engine would not load it at all.
        raise ValueError(
            f"--actor.lora.target_modules {' '.join(lora.target_modules)} matches lm_head: "
            "adapt the decoder's projections (e.g. '*_proj'), not the LM head"
        )


def validate_actor_devices(actor: ActorConfig, fsdp: FSDPConfig, num_gpus_available: int) -> None:
    """What depends on the cluster's GPUs (0 on CPU), once Ray knows them."""
    n, on_gpu = actor.num_workers, num_gpus_available > 0
    if not on_gpu and max(fsdp.tp_size, fsdp.ep_size) > 1:
        raise ValueError("--fsdp.tp_size / --fsdp.ep_size > 1 need GPUs (AutoModel's TP and EP)")
    if on_gpu and n > num_gpus_available:
        raise ValueError(f"--actor.num_workers {n} exceeds the {num_gpus_available} GPUs available")


def lr_at(step: int, optim: OptimConfig) -> float:
    """The learning rate of 0-based step `step`: warmup, then constant, linear or cosine."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    progress = min(1.0, (step - optim.warmup_steps) / (optim.total_steps - optim.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    shape = 1.0 - progress if optim.schedule == "linear" else cosine
    return optim.min_lr + (optim.lr - optim.min_lr) * shape


def router_params(names: list[str]) -> list[str]:
    """The MoE router weights among parameter names (frozen by --actor.freeze_moe_router)."""
    return [name for name in names if ROUTER_MARKER in name]
