"""One optimizer step's metrics, summed over microbatches, then ranks in one collective."""

# Device scalars until the step ends: a read per microbatch would make the host wait mid-step.

from __future__ import annotations

import resource

import torch
import torch.distributed as dist


class StepMetrics:
    def __init__(self) -> None:
        self.totals: dict = {}  # summed over microbatches and ranks
        self.weighted: dict = {}  # sums of value x tokens: token-weighted means

    def add(self, totals: dict, per_token: dict, tokens: torch.Tensor) -> None:
        for key, value in totals.items():
            self.totals[key] = self.totals.get(key, 0.0) + value
        for key, value in per_token.items():
            self.weighted[key] = self.weighted.get(key, 0.0) + value * tokens

    def reduce(self, num_tokens: int, replicas: int, device: torch.device) -> dict[str, float]:
        """Summed over ranks (same keys on each), the weighted ones over `num_tokens`."""
        # `replicas` (TP x CP) ranks hold each data-parallel share's values.
        totals, weighted = sorted(self.totals), sorted(self.weighted)
        entries = [self.totals[k] for k in totals] + [self.weighted[k] for k in weighted]
        values = torch.stack([torch.as_tensor(v, device=device).detach().double() for v in entries])
        dist.all_reduce(values)
        values = (values / replicas).tolist()
        means = [v / max(num_tokens, 1) for v in values[len(totals) :]]
        return dict(zip(totals + weighted, values[: len(totals)] + means, strict=True))


def peak_memory_gb(on_gpu: bool, device: torch.device) -> float:
    """The largest rank's peak: CUDA allocations on GPU, the process's resident set on CPU."""
    if on_gpu:
        peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device=device)
    else:  # the process's peak resident set (Linux reports KiB)
        peak = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak)
