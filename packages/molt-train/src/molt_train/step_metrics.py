"""One optimizer step's metrics, reduced over its microbatches and the world's ranks (every
rank calls these at once: each is a collective). molt_train.model_worker's train_step uses
them."""

from __future__ import annotations

import resource

import torch
import torch.distributed as dist


def all_reduce_step_metrics(
    totals: dict[str, torch.Tensor | float],
    weighted: dict[str, torch.Tensor | float],
    num_tokens: int,
    replicas: int,
    device: torch.device,
) -> dict[str, float]:
    """`totals` summed over ranks; `weighted` (sums of value x tokens) summed, then divided by
    the window's `num_tokens`: token-weighted means; `replicas` ranks (TP x CP) hold each
    data-parallel share's values. Every rank must pass the same keys. The
    values may be device scalars: they are read here, in one go."""
    keys = sorted(totals), sorted(weighted)
    entries = [totals[k] for k in keys[0]] + [weighted[k] for k in keys[1]]
    values = (
        torch.stack([torch.as_tensor(v, device=device).detach().to(torch.float64) for v in entries])
        if entries
        else torch.zeros(0, dtype=torch.float64, device=device)
    )
    dist.all_reduce(values)
    values = (values / replicas).tolist()  # the ranks holding one copy of the data
    out = dict(zip(keys[0], values[: len(keys[0])], strict=True))
    for key, value in zip(keys[1], values[len(keys[0]) :], strict=True):
        out[key] = value / max(num_tokens, 1)
    return out


def peak_memory_gb(on_gpu: bool, device: torch.device) -> float:
    """The largest rank's peak: CUDA allocations on GPU, the process's resident set on CPU."""
    if on_gpu:
        peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device=device)
    else:  # the process's peak resident set (Linux reports KiB)
        peak = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak)
