"""Masked reductions shared by the estimators, losses and corrections.

`mask` is always a bool tensor of the same shape as the values; positions outside it never
contribute, and a NaN or inf there cannot leak into a sum (`torch.where`, not multiplication).
"""

import torch
from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, values, torch.zeros_like(values)).sum()


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over the masked positions; 0 (not NaN) when the mask is empty."""
    return masked_sum(values, mask) / mask.sum().clamp(min=1)


def masked_std(values: Tensor, mask: Tensor) -> Tensor:
    """Population standard deviation over the masked positions; 0 when the mask is empty."""
    mean = masked_mean(values, mask)
    return masked_mean((values - mean) ** 2, mask).sqrt()


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / (std + eps) over the masked positions; 0 outside the mask."""
    normalised = (values - masked_mean(values, mask)) / (masked_std(values, mask) + eps)
    return torch.where(mask, normalised, torch.zeros_like(values))


def masked_min_max(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(min, max) over the masked positions; (0, 0) when the mask is empty."""
    if not mask.any():
        zero = values.new_zeros(())
        return zero, zero
    selected = values[mask]
    return selected.min(), selected.max()


def to_floats(metrics: dict[str, Tensor | float]) -> dict[str, float]:
    """Scalar tensors to plain floats with a single device sync for all of them."""
    device = next((v.device for v in metrics.values() if isinstance(v, Tensor)), "cpu")
    stacked = torch.stack(
        [torch.as_tensor(v, device=device).detach().to(torch.float64) for v in metrics.values()]
    )
    return dict(zip(metrics, stacked.tolist(), strict=True))


# |log ratio| bound before exp() in every ratio (losses, IS correction, KL): finite, NaN-free.
LOG_RATIO_LIMIT = 20.0


def safe_log_ratio(
    logprobs: Tensor, other_logprobs: Tensor, mask: Tensor, limit: float = LOG_RATIO_LIMIT
) -> Tensor:
    """log p - log q on masked tokens, 0 elsewhere; NaN -> 0 and +-inf -> +-limit, then clamped
    to [-limit, limit], so exp() of it is finite and masked positions carry no NaN into the
    gradient."""
    diff = torch.where(
        mask,
        logprobs.float() - other_logprobs.float(),
        torch.zeros_like(logprobs, dtype=torch.float32),
    )
    return torch.nan_to_num(diff, nan=0.0, posinf=limit, neginf=-limit).clamp(-limit, limit)
