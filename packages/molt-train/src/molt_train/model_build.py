"""One rank's sharded model, fp32 master weights (docs/concepts/trainer.md, "Model build")."""

# AutoModel's factory on GPU, or transformers and AutoModel's FSDP2 parallelizer.

# The transformers path on CPU (AutoModel's factories call into CUDA) and for the critic (the
# factory rejects its new value head).

from __future__ import annotations

import torch

from molt_train.actor_config import ROUTER_MARKER, ActorConfig, LoRAConfig, router_params
from molt_train.lora import peft_config


def policy_class(multimodal: bool):
    """transformers' auto class of a policy (a VLM's takes pixel values, has the LM head)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if multimodal else AutoModelForCausalLM


def is_multimodal(path: str) -> bool:
    """Whether the checkpoint is a vision-language model (its config has a vision tower)."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None


def distributed_setup(cfg: ActorConfig, fsdp, world_size: int, compute, offload: bool):
    """AutoModel's FSDP2 setup: fp32 weights, reduction and Adam states (`offload`: host)."""
    from nemo_automodel.components.distributed.config import DistributedSetup, FSDP2Config
    from nemo_automodel.components.distributed.mesh import ParallelismSizes
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    strategy = FSDP2Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32),
        offload_policy=CPUOffloadPolicy() if offload else None,
        reshard_after_forward=fsdp.reshard_after_forward,
        activation_checkpointing=cfg.gradient_checkpointing,
    )
    sizes = ParallelismSizes(tp_size=fsdp.tp_size, cp_size=fsdp.cp_size, ep_size=fsdp.ep_size)
    checkpointing = dict(activation_checkpointing=cfg.gradient_checkpointing)
    return DistributedSetup.build(strategy, sizes, world_size=world_size, **checkpointing)


def build_model(
    path: str, cfg: ActorConfig, role, lora: LoRAConfig | None, routing, device, distributed
) -> torch.nn.Module:
    if device.type == "cuda" and role != "critic":
        return _automodel(path, cfg, lora, routing, distributed)
    from nemo_automodel.components._peft.lora import apply_lora_to_linear_modules
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
    from transformers import AutoModelForTokenClassification

    if role == "critic":  # the backbone with a one-output token head
        model = AutoModelForTokenClassification.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa", num_labels=1
        )
        # No dropout in the head: old and new values of the same weights must agree for the
        # clipped value loss.
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    else:
        model = policy_class(is_multimodal(path)).from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa"
        )
    if lora is not None:  # base frozen, adapters added, before sharding as on GPU
        apply_lora_to_linear_modules(model, peft_config(lora))
    if cfg.freeze_moe_router:  # before sharding: FSDP reads requires_grad then
        for name in router_params([name for name, _ in model.named_parameters()]):
            model.get_parameter(name).requires_grad_(False)
    return parallelize_model(model.to(device), distributed.mesh_context)


def _automodel(
    path: str, cfg: ActorConfig, lora: LoRAConfig | None, routing: str | None, distributed
) -> torch.nn.Module:
    from nemo_automodel import NeMoAutoModelForCausalLM, NeMoAutoModelForImageTextToText
    from nemo_automodel.components.utils.model_utils import FreezeConfig, ModuleSelector

    # No Liger kernels: the trainer computes log-probs itself from the hidden states.
    extra = dict(distributed_setup=distributed, dtype=torch.float32, use_liger_kernel=False)
    if routing:  # each native gate gets a RouterReplay handle (replaying or not)
        extra["moe_overrides"] = {"enable_routing_replay": True}
    if cfg.freeze_moe_router:  # applied before sharding
        router = ModuleSelector(glob="*" + ROUTER_MARKER.rstrip("."))
        extra["freeze_config"] = FreezeConfig(freeze_modules=[router])
    if lora is not None:  # adapters added and the base frozen before sharding
        extra["peft_config"] = peft_config(lora)
    multimodal = is_multimodal(path)
    factory = NeMoAutoModelForImageTextToText if multimodal else NeMoAutoModelForCausalLM
    return factory.from_pretrained(path, **extra)
