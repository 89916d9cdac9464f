"""Batch shaping and evaluation over prompt groups: the dynamic group filter and pass@k."""

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass
class GroupFilter:
    keep: Tensor  # [N] bool per rollout: its group is kept
    kept_groups: Tensor  # group ids kept, ascending
    metrics: dict[str, float]


def dynamic_group_filter(
    scores: Tensor, group_ids: Tensor, low: float = 0.0, high: float = 1.0
) -> GroupFilter:
    """DAPO-style dynamic sampling: keep a group iff low < mean score < high (strictly).

    With 0/1 scores and the default band this drops groups where every sample passed or every
    sample failed: their group-relative advantages are all zero. One entry per rollout.
    Metrics: `filter/pass_rate` (mean score over rollouts), `filter/all_pass_frac` (groups with
    mean >= high), `filter/all_fail_frac` (mean <= low), `filter/kept_frac` (groups kept)."""
    unique, group_index = torch.unique(group_ids, return_inverse=True)
    scores = scores.double()
    totals = torch.zeros(len(unique), dtype=torch.float64).index_add_(0, group_index, scores)
    counts = torch.zeros(len(unique), dtype=torch.float64).index_add_(
        0, group_index, torch.ones_like(scores)
    )
    means = totals / counts
    kept = (means > low) & (means < high)
    num_groups = max(len(unique), 1)
    metrics = {
        "filter/pass_rate": scores.mean().item() if scores.numel() else 0.0,
        "filter/all_pass_frac": (means >= high).sum().item() / num_groups,
        "filter/all_fail_frac": (means <= low).sum().item() / num_groups,
        "filter/kept_frac": kept.sum().item() / num_groups,
    }
    return GroupFilter(kept[group_index], unique[kept], metrics)


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k (Chen et al., 2021): 1 - C(n - c, k) / C(n, k), the probability that at
    least one of k samples drawn without replacement from the n is correct. Computed as
    1 - prod_{i = n-c+1}^{n} (1 - k / i) to stay stable for large n."""
    if not 0 <= num_correct <= num_samples or not 1 <= k <= num_samples:
        raise ValueError(
            f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={num_samples}, c={num_correct}, k={k}"
        )
    if num_samples - num_correct < k:
        return 1.0
    i = np.arange(num_samples - num_correct + 1, num_samples + 1, dtype=np.float64)
    return float(1.0 - np.prod(1.0 - k / i))


def mean_pass_at_k(correct_per_group: list[list[bool]], k: int) -> float:
    """pass@k averaged over prompts; each entry lists one prompt's n sample outcomes."""
    if not correct_per_group:
        return 0.0
    values = [pass_at_k(len(group), sum(group), k) for group in correct_per_group]
    return float(np.mean(values))
