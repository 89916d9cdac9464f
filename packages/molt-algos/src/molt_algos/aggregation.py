"""Per-token losses [B, T] to the scalar that is backpropagated.

The default, `token-mean`, divides the sum over every trainable token of the optimizer-step
window by one denominator: the number of unmasked tokens across all microbatches and all
data-parallel ranks of that window (the trainer counts it once, before the first microbatch,
and passes it in). Each microbatch's loss is then its share of one global mean, so the
accumulated update is the same whatever the microbatch split or data-parallel size. Every
mode keeps that contract: whatever a mode divides by (tokens, sequences, prompt groups, a
group's tokens) is a count over the whole window, passed in as an `AggregationWindow`.

Data-parallel gradient reduction (FSDP's reduce-scatter) *averages* over ranks; `dp_size`
multiplies it back, so that the averaged gradient equals the gradient of the global mean.

The same contract serves policy, KL, entropy and value losses. Modes are selected by name
through `AGGREGATIONS`.
"""

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from molt_algos.masked import masked_sum


@dataclass(frozen=True)
class AggregationWindow:
    """Counts over the whole optimizer-step window (every microbatch of every rank). A count
    left None is taken from the tensors of the call: right for one microbatch on one rank."""

    num_tokens: float | None = None  # unmasked tokens in the window
    num_sequences: float | None = None  # rows with at least one unmasked token
    num_groups: float | None = None  # prompt groups with at least one unmasked token
    group_tokens: Tensor | None = None  # [B] unmasked tokens of each row's group, window-wide
    group_ids: Tensor | None = None  # [B] each row's prompt group: local counts from these


def token_mean(per_token: Tensor, mask: Tensor, window: AggregationWindow) -> Tensor:
    """sum_{b,t} m_bt * l_bt / N, N = unmasked tokens in the optimizer-step window."""
    n = mask.sum() if window.num_tokens is None else torch.as_tensor(window.num_tokens)
    return masked_sum(per_token, mask) / n.clamp(min=1)


def seq_mean_token_mean(per_token: Tensor, mask: Tensor, window: AggregationWindow) -> Tensor:
    """sum_b (sum_t m_bt * l_bt / sum_t m_bt) / S, S = non-empty rows in the window. Every
    sequence weighs the same whatever its length (GRPO's original normalisation)."""
    tokens = mask.sum(-1)
    per_row = _row_sums(per_token, mask) / tokens.clamp(min=1)
    return per_row.sum() / _sequences(tokens, window.num_sequences)


def seq_mean_token_sum(per_token: Tensor, mask: Tensor, window: AggregationWindow) -> Tensor:
    """sum_b sum_t m_bt * l_bt / S, S = non-empty rows in the window (Dr. GRPO with a fixed
    length constant folded into the learning rate)."""
    return masked_sum(per_token, mask) / _sequences(mask.sum(-1), window.num_sequences)


def prompt_mean_token_mean(per_token: Tensor, mask: Tensor, window: AggregationWindow) -> Tensor:
    """sum_g (sum_{b in g} sum_t m_bt * l_bt / N_g) / G: the token mean of each prompt group
    (N_g its unmasked tokens in the window), averaged over the G non-empty groups of the
    window. Every prompt weighs the same, however many or long its samples."""
    group_tokens, num_groups = _group_counts(mask, window)
    per_row = _row_sums(per_token, mask) / group_tokens.to(per_token.device).clamp(min=1)
    return per_row.sum() / torch.as_tensor(num_groups).clamp(min=1)


def _row_sums(per_token: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, per_token, torch.zeros_like(per_token)).sum(-1)


def _sequences(tokens_per_row: Tensor, num_sequences: float | None) -> Tensor:
    count = (tokens_per_row > 0).sum() if num_sequences is None else torch.as_tensor(num_sequences)
    return count.clamp(min=1)


def _group_counts(mask: Tensor, window: AggregationWindow) -> tuple[Tensor, Tensor | float]:
    """(tokens of each row's group [B], number of non-empty groups): the window's, or counted
    from `group_ids` over this call's rows."""
    if window.group_tokens is not None:
        if window.num_groups is None:
            raise ValueError("prompt-mean-token-mean: group_tokens given without num_groups")
        return window.group_tokens.float(), float(window.num_groups)
    if window.group_ids is None:
        raise ValueError(
            "prompt-mean-token-mean needs each row's prompt group: pass window counts "
            "(group_tokens and num_groups) or group_ids"
        )
    _, group_of_row = torch.unique(window.group_ids, return_inverse=True)
    tokens = mask.sum(-1).float()
    per_group = torch.zeros(int(group_of_row.max()) + 1 if tokens.numel() else 0)
    per_group = per_group.to(tokens.device).index_add_(0, group_of_row, tokens)
    num_groups = (per_group > 0).sum() if window.num_groups is None else window.num_groups
    return per_group[group_of_row], num_groups


AGGREGATIONS = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "prompt-mean-token-mean": prompt_mean_token_mean,
}
AggregationName = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "prompt-mean-token-mean"
]  # the keys of AGGREGATIONS
# Modes that need each row's prompt group (the trainer passes group counts for these only).
GROUP_AGGREGATIONS = {"prompt-mean-token-mean"}


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    dp_size: int = 1,
    window: AggregationWindow | None = None,
) -> Tensor:
    """Reduce a per-token loss with `mode`. `num_tokens` / `num_sequences` (or `window`, which
    also carries the group counts prompt-mean-token-mean needs) are the window's global counts
    (local counts when None: a single microbatch on a single rank). An empty mask gives
    exactly 0 with a zero (never NaN) gradient."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {sorted(AGGREGATIONS)}")
    if window is None:
        window = AggregationWindow(num_tokens, num_sequences)
    elif num_tokens is not None or num_sequences is not None:
        raise ValueError("pass the window's counts either as num_tokens/num_sequences or window")
    return AGGREGATIONS[mode](per_token, mask, window) * dp_size
