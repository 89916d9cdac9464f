"""Masked reductions: positions outside the bool `mask` never contribute, and a NaN or inf there
cannot leak into a sum (`torch.where`, not multiplication). An empty mask gives 0, not NaN."""

import torch
from torch import Tensor

# |log ratio| bound before exp() in every ratio (losses, IS correction, KL): finite, NaN-free.
LOG_RATIO_LIMIT = 20.0


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, values, torch.zeros_like(values)).sum()


def row_sums(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, values, torch.zeros_like(values)).sum(-1)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return masked_sum(values, mask) / mask.sum().clamp(min=1)


def masked_std(values: Tensor, mask: Tensor) -> Tensor:  # population standard deviation
    return masked_mean((values - masked_mean(values, mask)) ** 2, mask).sqrt()


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    normalised = (values - masked_mean(values, mask)) / (masked_std(values, mask) + eps)
    return torch.where(mask, normalised, torch.zeros_like(values))


def masked_min_max(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    if not mask.any():
        return values.new_zeros(()), values.new_zeros(())
    return values[mask].min(), values[mask].max()


def to_floats(metrics: dict[str, Tensor | float]) -> dict[str, float]:
    """Scalar tensors to plain floats with a single device sync for all of them."""
    device = next((v.device for v in metrics.values() if isinstance(v, Tensor)), "cpu")
    values = [torch.as_tensor(v, device=device).detach().double() for v in metrics.values()]
    return dict(zip(metrics, torch.stack(values).tolist(), strict=True))


def safe_log_ratio(
    logprobs: Tensor, other_logprobs: Tensor, mask: Tensor, limit: float = LOG_RATIO_LIMIT
) -> Tensor:
    """log p - log q on masked tokens (0 elsewhere, NaN -> 0), clamped to [-limit, limit]: its
    exp() is finite and no NaN reaches the gradient."""
    diff = logprobs.float() - other_logprobs.float()
    diff = torch.where(mask, diff, torch.zeros_like(diff))
    return torch.nan_to_num(diff, nan=0.0, posinf=limit, neginf=-limit).clamp(-limit, limit)
