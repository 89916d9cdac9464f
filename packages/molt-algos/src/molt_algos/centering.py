"""Score centering: y_t was drawn from the sampler mu, so the score c_t d log pi(y_t) is made
zero-mean under mu's renormalised top-K head (docs/concepts/algorithms.md)."""

import torch
from torch import Tensor

from molt_algos.masked import masked_mean

# The metrics `score_centering` returns (a trainer reports them as 0 where it centres nothing).
CENTERING_METRICS = ("loss/centering_head_mass", "loss/centering_coef_mean")


def score_centering(
    per_token: Tensor,
    logprobs: Tensor,
    head_logprobs: Tensor,
    sampler_head_logprobs: Tensor,
    mask: Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`head_logprobs` [B, T, K]: the policy's log-probs of the sampler's top-K (differentiable);
    `sampler_head_logprobs`, the sampler's own, are -inf where a position has fewer."""
    if head_logprobs.shape != sampler_head_logprobs.shape or head_logprobs.shape[:2] != mask.shape:
        shapes = [list(x.shape) for x in (head_logprobs, sampler_head_logprobs, mask)]
        raise ValueError(f"head log-probs {shapes[0]}, {shapes[1]}: both [B, T, K], mask [B, T]")
    (grad,) = torch.autograd.grad(per_token.sum(), logprobs, retain_graph=True, allow_unused=True)
    coef = torch.zeros_like(per_token) if grad is None else -grad.detach()
    sampler = sampler_head_logprobs.detach().float()
    present = torch.isfinite(sampler) & (sampler <= 0)  # -inf and NaN: no candidate
    has_head = mask & present.any(-1)
    safe = torch.where(present, sampler, torch.full_like(sampler, -1e30))
    weights = torch.where(present, torch.softmax(safe, dim=-1), torch.zeros_like(safe))
    policy = torch.where(present, head_logprobs.float(), torch.zeros_like(safe))
    expected = (weights * policy).sum(-1)  # sum_j mu~(j) log pi(j)
    # Value 0, gradient c_t * sum_j mu~(j) d log pi(j): the loss reads as before.
    term = torch.where(has_head, coef * (expected - expected.detach()), torch.zeros_like(expected))
    mass = torch.where(present, sampler.exp(), torch.zeros_like(sampler)).sum(-1)
    metrics = {
        "loss/centering_head_mass": masked_mean(mass, has_head),
        "loss/centering_coef_mean": masked_mean(coef.abs(), mask),
    }
    return per_token + term, metrics
