"""LoRA on the policy (Hu et al., 2021, arXiv:2106.09685) with NeMo AutoModel's own adapters.

A targeted linear layer with frozen weight W computes W x + s B A x, s = alpha / rank, A
[rank, in] (AutoModel's init: Xavier-normal) and B [out, rank] (zeros, so training starts from
the base policy); only A and B train. AutoModel's `LinearLoRA` keeps W under its own name and adds
`<layer>.lora_A.weight` / `<layer>.lora_B.weight`, so sharding, checkpoints and the optimizer see
ordinary parameters. The adapters go on before FSDP2 shards the model: through the factory's
`peft_config` on GPU, `add_adapters` on CPU.

Out of the trainer, the engines get the merged weight W + s B A under W's name (`merge_adapters`):
the policy they serve is exactly the one trained, and vLLM needs no LoRA support. The adapter
alone leaves as a PEFT checkpoint (`write_adapter`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # actor_config validates with this module's matcher: no cycle at run time
    from molt_train.actor_config import LoRAConfig

ADAPTER_KEYS = (".lora_A.weight", ".lora_B.weight")


def adapts_lm_head(target_modules: list[str]) -> bool:
    """Whether a pattern of --actor.lora.target_modules selects the LM head (AutoModel's
    matcher: the pattern equals the module's name or matches it with wildcards)."""
    from nemo_automodel.components._peft.module_matcher import wildcard_match

    return any(p == "lm_head" or wildcard_match(p, "lm_head") for p in target_modules)


def peft_config(lora: LoRAConfig):
    """AutoModel's PeftConfig for --actor.lora.*: no dropout (the served, merged policy has
    none, and the log-probs the loss compares must be those of one fixed policy), no DoRA."""
    from nemo_automodel.components._peft.lora import PeftConfig

    return PeftConfig(
        target_modules=list(lora.target_modules), dim=lora.rank, alpha=lora.alpha, dropout=0.0
    )


def add_adapters(model: torch.nn.Module, lora: LoRAConfig) -> None:
    """Freeze `model` and add the adapters in place (the CPU path, before sharding)."""
    from nemo_automodel.components._peft.lora import apply_lora_to_linear_modules

    apply_lora_to_linear_modules(model, peft_config(lora))


def adapter_scales(model: torch.nn.Module) -> dict[str, float]:
    """{adapted layer's module name: s} of a built model. Refuses a model where the targets
    matched nothing, or matched modules whose merged weight `merge_adapters` cannot form
    (AutoModel's grouped MoE experts)."""
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
    """(name, tensor) in state-dict order with every adapted layer's W, A and B replaced by one
    W + s B A under W's name, summed in fp32 and returned in W's dtype (AutoModel may store a
    frozen W in the compute dtype on GPU). A layer's W comes before its adapters in the state
    dict, so it waits here until both have passed: one layer's weight at a time."""
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
    """The adapters as a Hugging Face PEFT checkpoint (adapter_model.safetensors and
    adapter_config.json: `PeftModel.from_pretrained(base, path)` and vLLM's LoRA loader read
    it); `named` holds the adapter tensors under the base model's layer names."""
    from safetensors.torch import save_file

    final = Path(path)
    out = final.with_name(final.name + ".tmp")  # renamed into place: a crash leaves no half
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    named_ = {name: t.cpu().contiguous() for name, t in named}
    tensors = {f"base_model.model.{name}": t for name, t in named_.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    # The adapted layers by full name: PEFT adapts exactly these (its names match as suffixes).
    targets = sorted({name.removesuffix(k) for name in named_ for k in ADAPTER_KEYS
                      if name.endswith(k)})  # fmt: skip
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
