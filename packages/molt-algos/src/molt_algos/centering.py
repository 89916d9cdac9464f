"""Score centering: the policy gradient's score made zero-mean under the sampler's own head.

A token's loss L_t reaches the parameters through its log-prob: dL_t = -c_t d log pi(y_t),
c_t = -dL_t / d log pi(y_t) (A_t for REINFORCE, r_t A_t for unclipped PPO, 0 where clipped).
Its score d log pi(y_t) has mean zero under pi, but y_t was drawn from the sampler mu (older
weights, another kernel). Score centering subtracts the sampler's expected score over its
top-K head H_t, with mu~ = mu renormalised over H_t:

    d log pi(y_t)  ->  d log pi(y_t) - sum_{j in H_t} mu~(j) d log pi(j)

On the logits z this is e_{y_t} - mu~ in place of e_{y_t} - pi: zero-mean under the sampler,
whatever pi is. It is added to the loss as sg(c_t) * sum_j sg(mu~(j)) log pi(j) (minus its own value, so the
loss reads the same), so it composes
with per-token IS weights and any aggregation (both act on L_t and on the term alike).
Formula and caveats: docs/algorithms.md.
"""

import torch
from torch import Tensor

from molt_algos.masked import masked_mean

# The metrics `score_centering` returns (a trainer reports them on every rank, 0 where it had
# nothing to centre, so that distributed reductions see the same keys everywhere).
CENTERING_METRICS = ("loss/centering_head_mass", "loss/centering_coef_mean")


def score_centering(
    per_token: Tensor,
    logprobs: Tensor,
    head_logprobs: Tensor,
    sampler_head_logprobs: Tensor,
    mask: Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`per_token` [B, T]: the policy loss (IS weights included), a function of `logprobs`
    [B, T], the policy's log-probs of the sampled tokens. `head_logprobs` [B, T, K]: the
    policy's log-probs of the sampler's top-K tokens at each position (differentiable);
    `sampler_head_logprobs` [B, T, K]: the sampler's log-probs of the same tokens, -inf where
    a position has fewer than K (or none). Returns the centred per-token loss and metrics:
    `loss/centering_head_mass` (the sampler's probability mass its head covers, mean over
    masked tokens with a head) and `loss/centering_coef_mean` (mean |c_t|)."""
    if head_logprobs.shape != sampler_head_logprobs.shape or head_logprobs.shape[:2] != mask.shape:
        raise ValueError(
            f"head log-probs {tuple(head_logprobs.shape)} and sampler head "
            f"{tuple(sampler_head_logprobs.shape)} must both be [B, T, K] over mask "
            f"{tuple(mask.shape)}"
        )
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
    metrics = {  # scalar tensors, read with the step's other metrics (losses.PolicyLoss)
        "loss/centering_head_mass": masked_mean(mass, has_head),
        "loss/centering_coef_mean": masked_mean(coef.abs(), mask),
    }
    return per_token + term, metrics
