"""MoE routing against the engine's: `routing/agreement` always, replay with
`--train.routing_replay` (routers take the engine's recorded experts)."""

# The weights stay the router's own probabilities at those experts.

# A flipped choice would leave the recomputed log-prob describing another policy; the weights
# keep the router's gradient. AutoModel's native gates (GPU) replay through their
# `RouterReplay` handle, transformers' softmax top-k routers (CPU) through a forward hook.

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

# transformers routers whose forward is softmax -> top-k -> optional renormalisation, returning
# (logits, top-k weights, top-k indices): what the hook reproduces (tests/test_routing.py).
HF_SOFTMAX_ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter")
_LAYER = re.compile(r"layers\.(\d+)\.")


def moe_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, router) for every router the trainer can replay, in layer order."""
    routers = []
    for name, module in model.named_modules():
        native = getattr(module, "router_replay", None) is not None  # AutoModel's Gate
        if native or type(module).__name__ in HF_SOFTMAX_ROUTERS:
            routers.append((int(_LAYER.search(name).group(1)), module))
    return routers


def _replay_hook(router: torch.nn.Module, inputs, output):
    target = router._molt_replay
    if target is None:
        return output
    logits, weights, indices = output
    if target.shape != indices.shape:
        raise ValueError(
            f"routing replay: {tuple(target.shape)} recorded choices for a "
            f"{tuple(indices.shape)} selection (tokens x top_k)"
        )
    chosen = torch.softmax(logits.float(), dim=-1).gather(1, target)
    if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalises
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return logits, chosen.to(weights.dtype), target


def _agreement_hook(router: torch.nn.Module, inputs, output) -> None:
    """Counts the tokens whose expert set is the engine's, after any replay took effect."""
    engine = router._molt_engine  # [tokens, top_k], -1 where the engine reported none
    if engine is None:
        return
    used = output[1] if getattr(router, "router_replay", None) is not None else output[2]
    known = (engine >= 0).all(-1)
    same = (used.sort(-1).values == engine.sort(-1).values).all(-1) & known
    router._molt_agreed.append(torch.stack([same.sum(), known.sum()]))


def install_replay_hooks(routers: list[tuple[int, torch.nn.Module]]) -> None:
    """Once per model: transformers routers replay whatever `replaying` hands them; every
    router counts its agreement with the engine (read by `agreement`)."""
    for _, router in routers:
        router._molt_engine, router._molt_agreed = None, []
        if getattr(router, "router_replay", None) is None:
            router._molt_replay = None
            router.register_forward_hook(_replay_hook)
        router.register_forward_hook(_agreement_hook)


def agreement(routers: list[tuple[int, torch.nn.Module]]) -> dict[str, Tensor]:
    """(token, layer) pairs routed as the engine did, and those compared, since the last call."""
    counts = [count for _, router in routers for count in router._molt_agreed]
    for _, router in routers:
        router._molt_agreed = []
    agreed, known = torch.stack(counts).sum(0) if counts else torch.zeros(2)
    return {"routing/agreed": agreed, "routing/compared": known}


@contextlib.contextmanager
def replaying(routers: list, routing: Tensor | None, replay: bool = True) -> Iterator[None]:
    """Inside the block (recomputations too) every router compares its experts with its
    layer's recorded ones and, with `replay`, takes those."""
    if routing is None or not routers:  # a reference or critic gets the samples' routing too
        yield
        return
    from nemo_automodel.components.moe.router_replay import RouterReplayMode

    # Tokens the engine reported no experts for (and padding) go to experts 0..k-1: their
    # outputs reach no trained log-prob.
    if replay:
        fill = torch.arange(routing.shape[-1], device=routing.device).expand_as(routing)
        target = torch.where(routing < 0, fill, routing)
    for layer, router in routers:
        if layer >= routing.shape[0]:
            raise ValueError(f"routing replay: no recorded routing for decoder layer {layer}")
        native = getattr(router, "router_replay", None)
        router._molt_engine = routing[layer]
        if replay and native is not None:
            native.set_target(target[layer])
            native.mode = RouterReplayMode.REPLAY
        elif replay:
            router._molt_replay = target[layer]
    try:
        yield
    finally:
        for _, router in routers:
            router._molt_engine = router._molt_replay = None
            if (native := getattr(router, "router_replay", None)) is not None:
                native.clear()
                native.mode = None


def routing_array(rows: list) -> np.ndarray:
    """A segment's routed experts as [tokens, layers, top_k] int16, -1 where none was run."""
    known = next((row for row in rows if row is not None), None)
    if known is None:
        raise ValueError("routing replay: the segment has no routed experts")
    out = np.full((len(rows), len(known), len(known[0])), -1, dtype=np.int16)
    for t, row in enumerate(rows):
        if row is not None:
            out[t] = row
    return out


def microbatch_routing(arrays: list[np.ndarray], width: int | None) -> Tensor:
    """Per-sample routing arrays, concatenated or each padded to `width` (padded rows; -1) ->
    the microbatch's [layers, tokens, top_k] tensor."""
    if width is not None:
        arrays = [
            np.pad(a, ((0, width - len(a)), (0, 0), (0, 0)), constant_values=-1) for a in arrays
        ]
    return torch.from_numpy(np.concatenate(arrays)).long().permute(1, 0, 2).contiguous()
