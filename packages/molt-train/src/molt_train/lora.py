"""LoRA on the policy with AutoModel's adapters: W x + s B A x, s = alpha / rank, W frozen."""

# docs/concepts/trainer.md, "LoRA". Served merged (`merge_adapters`) or as a PEFT adapter.

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from molt_train.actor_config import LoRAConfig

ADAPTER_KEYS = (".lora_A.weight", ".lora_B.weight")


def peft_config(lora: LoRAConfig):
    """AutoModel's PeftConfig for --actor.lora.*, without dropout or DoRA."""
    # No dropout: the served, merged policy has none, and the log-probs the loss compares must
    # be those of one fixed policy.
    from nemo_automodel.components._peft.lora import PeftConfig

    return PeftConfig(
        target_modules=list(lora.target_modules), dim=lora.rank, alpha=lora.alpha, dropout=0.0
    )


def adapter_scales(model: torch.nn.Module) -> dict[str, float]:
    """{adapted layer: s}; refuses targets matching nothing or no plain linear layer."""
    from nemo_automodel.components._peft.lora import LinearLoRA

    scales, other = {}, []
    for name, module in model.named_modules():
        if isinstance(module, LinearLoRA):
            scales[name] = float(module.scale)
        elif any(n.startswith("lora_") for n, _ in module.named_parameters(recurse=False)):
            other.append(name)
    if other:
        raise ValueError(
            f"--actor.lora.target_modules matches {other[0]} ({len(other)} such modules), which "
            "is not a plain linear layer: only linear layers are merged for the engines"
        )
    if not scales:
        raise ValueError("--actor.lora.target_modules matches no linear layer of the model")
    return scales


def merge_adapters(
    named: Iterable[tuple[str, Tensor]], scales: dict[str, float]
) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) with each adapted layer's W, A and B as W + s B A under W's name."""
    # Summed in fp32, returned in W's dtype (a frozen W may be in the compute dtype).
    # W comes before its adapters in the state dict: it waits, one layer's weight at a time.
    waiting: dict[str, dict[str, Tensor]] = {}
    for name, tensor in named:
        layer = adapted_layer(name, scales)
        if layer is None:  # not adapted, or an adapted layer's bias: served as trained
            yield name, tensor
            continue
        parts = waiting.setdefault(layer, {})
        parts[name[len(layer) + 1 :]] = tensor  # "weight", "lora_A.weight" or "lora_B.weight"
        if len(parts) == 3:
            del waiting[layer]
            w, a, b = parts["weight"], parts["lora_A.weight"], parts["lora_B.weight"]
            merged = w.float() + scales[layer] * (b.float() @ a.float())
            yield f"{layer}.weight", merged.to(w.dtype)
    if waiting:
        raise RuntimeError(f"LoRA layers without both adapters in the state dict: {list(waiting)}")


def adapted_layer(name: str, scales: dict[str, float]) -> str | None:
    """The adapted layer a state-dict entry belongs to (its W, A or B), or None."""
    for suffix in ADAPTER_KEYS + (".weight",):
        if name.endswith(suffix) and name[: -len(suffix)] in scales:
            return name[: -len(suffix)]
    return None


def write_adapter(
    path: str, named: Iterable[tuple[str, Tensor]], lora: LoRAConfig, base_model: str
) -> None:
    """The adapter tensors `named` as a PEFT checkpoint (PEFT and vLLM's LoRA loader read it)."""
    from safetensors.torch import save_file

    final = Path(path)
    out = final.with_name(final.name + ".tmp")  # renamed into place: a crash leaves no half
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    named_ = {name: t.cpu().contiguous() for name, t in named}
    tensors = {f"base_model.model.{name}": t for name, t in named_.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    # The adapted layers by full name: PEFT adapts exactly these (its names match as suffixes).
    targets = sorted({name.rsplit(".lora_", 1)[0] for name in named_})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "use_dora": False,
        "fan_in_fan_out": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(out, final)
