"""Per-token losses to the backpropagated scalar, divided by counts over the whole optimizer step
(`AggregationWindow`), so any split gives one global mean; `dp_size` undoes FSDP's averaging."""

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from molt_algos.masked import masked_sum, row_sums


@dataclass(frozen=True)
class AggregationWindow:
    """Counts over the step; None: the call's own (one microbatch on one rank)."""

    num_tokens: float | None = None  # unmasked tokens
    num_sequences: float | None = None  # rows with at least one unmasked token
    num_groups: float | None = None  # prompt groups with at least one unmasked token
    group_tokens: Tensor | None = None  # [B] unmasked tokens of each row's prompt group


def token_mean(per_token: Tensor, mask: Tensor, window: AggregationWindow) -> Tensor:
    """sum_{b,t} m_bt * l_bt / N, N = unmasked tokens in the window."""
    n = mask.sum() if window.num_tokens is None else torch.as_tensor(window.num_tokens)
    return masked_sum(per_token, mask) / n.clamp(min=1)


def seq_mean_token_mean(per_token: Tensor, mask: Tensor, window: AggregationWindow) -> Tensor:
    """sum_b (sum_t m_bt * l_bt / sum_t m_bt) / S, S = non-empty rows in the window: every
    sequence weighs the same whatever its length (GRPO's original normalisation)."""
    tokens = mask.sum(-1)
    return (row_sums(per_token, mask) / tokens.clamp(min=1)).sum() / _sequences(tokens, window)


def seq_mean_token_sum(per_token: Tensor, mask: Tensor, window: AggregationWindow) -> Tensor:
    """sum_{b,t} m_bt * l_bt / S (Dr. GRPO, its length constant folded into the learning rate)."""
    return masked_sum(per_token, mask) / _sequences(mask.sum(-1), window)


def prompt_mean_token_mean(per_token: Tensor, mask: Tensor, window: AggregationWindow) -> Tensor:
    """sum_g (sum_{b in g} sum_t m_bt * l_bt / N_g) / G over the window's G non-empty groups:
    every prompt weighs the same, however many or long its samples."""
    if window.group_tokens is None or window.num_groups is None:
        raise ValueError("prompt-mean-token-mean needs the window's group_tokens and num_groups")
    per_row = row_sums(per_token, mask) / window.group_tokens.to(per_token.device).clamp(min=1)
    return per_row.sum() / torch.as_tensor(float(window.num_groups)).clamp(min=1)


def _sequences(tokens_per_row: Tensor, window: AggregationWindow) -> Tensor:
    count = window.num_sequences
    return ((tokens_per_row > 0).sum() if count is None else torch.as_tensor(count)).clamp(min=1)


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
    *,
    dp_size: int = 1,
    window: AggregationWindow | None = None,
) -> Tensor:
    """Reduce a per-token loss with `mode` over `window` (None: this call's own counts). An
    empty mask gives exactly 0 with a zero (never NaN) gradient."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {sorted(AGGREGATIONS)}")
    return AGGREGATIONS[mode](per_token, mask, window or AggregationWindow()) * dp_size
