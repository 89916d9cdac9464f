"""Per-token losses [B, T] to the scalar that is backpropagated.

The default, `token-mean`, divides the sum over every trainable token of the optimizer-step
window by one denominator: the number of unmasked tokens across all microbatches and all
data-parallel ranks of that window (the trainer counts it once, before the first microbatch,
and passes it in). Each microbatch's loss is then its share of one global mean, so the
accumulated update is the same whatever the microbatch split or data-parallel size.

Data-parallel gradient reduction (FSDP's reduce-scatter) *averages* over ranks; `dp_size`
multiplies it back, so that the averaged gradient equals the gradient of the global mean.

The same contract serves policy, KL, entropy and value losses. Modes are selected by name
through `AGGREGATIONS`.
"""

from typing import Literal

import torch
from torch import Tensor

from molt_algos.masked import masked_sum


def token_mean(
    per_token: Tensor,
    mask: Tensor,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> Tensor:
    """sum_{b,t} m_bt * l_bt / N, N = unmasked tokens in the optimizer-step window."""
    denominator = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens)
    return masked_sum(per_token, mask) / denominator.clamp(min=1)


def seq_mean_token_mean(
    per_token: Tensor,
    mask: Tensor,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> Tensor:
    """sum_b (sum_t m_bt * l_bt / sum_t m_bt) / S, S = non-empty rows in the window. Every
    sequence weighs the same whatever its length (GRPO's original normalisation)."""
    tokens = mask.sum(-1)
    per_row = torch.where(mask, per_token, torch.zeros_like(per_token)).sum(-1) / tokens.clamp(
        min=1
    )
    return per_row.sum() / _sequences(tokens, num_sequences)


def seq_mean_token_sum(
    per_token: Tensor,
    mask: Tensor,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> Tensor:
    """sum_b sum_t m_bt * l_bt / S, S = non-empty rows in the window (Dr. GRPO with a fixed
    length constant folded into the learning rate)."""
    return masked_sum(per_token, mask) / _sequences(mask.sum(-1), num_sequences)


def _sequences(tokens_per_row: Tensor, num_sequences: float | None) -> Tensor:
    count = (tokens_per_row > 0).sum() if num_sequences is None else torch.as_tensor(num_sequences)
    return count.clamp(min=1)


AGGREGATIONS = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
}
AggregationName = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]  # the keys


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    dp_size: int = 1,
) -> Tensor:
    """Reduce a per-token loss with `mode`. `num_tokens` / `num_sequences` are the window's
    global counts (local counts when None: a single microbatch on a single rank). An empty
    mask gives exactly 0 with a zero (never NaN) gradient."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {sorted(AGGREGATIONS)}")
    return AGGREGATIONS[mode](per_token, mask, num_tokens, num_sequences) * dp_size
