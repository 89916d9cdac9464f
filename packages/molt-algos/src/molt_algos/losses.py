"""Policy losses and the value loss.

Every policy loss has the signature
`(logprobs, old_logprobs, advantages, mask, cfg) -> PolicyLoss` and returns a *per-token*
loss [B, T] (0 outside `mask`); reduction to a scalar is `molt_algos.aggregation.aggregate`,
which the trainer applies with the optimizer-step window's token count. Train/rollout
importance weights (molt_algos.correction) multiply the per-token loss before aggregation.

Selected by name through `POLICY_LOSSES`.
"""

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from molt_algos.masked import LOG_RATIO_LIMIT, masked_mean, safe_log_ratio


@dataclass
class LossConfig:
    clip_low: float = 0.2  # ratio clipped below at 1 - clip_low
    clip_high: float = 0.2  # ratio clipped above at 1 + clip_high (clip-higher: raise it)
    dual_clip: float | None = None  # c > 1: PPO loss bounded by c * |A| where A < 0


@dataclass
class PolicyLoss:
    per_token: Tensor  # [B, T], 0 outside the mask
    # Scalar tensors on the loss's device: a trainer reads a whole step's at once (e.g. with
    # masked.to_floats); a read here would make the host wait for the GPU mid-step.
    metrics: dict[str, Tensor]


def validate_loss_config(name: str, cfg: LossConfig) -> None:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {sorted(POLICY_LOSSES)}")
    if cfg.clip_low < 0 or cfg.clip_high < 0 or cfg.clip_low >= 1:
        raise ValueError(
            f"clip_low={cfg.clip_low}, clip_high={cfg.clip_high}: need 0 <= low < 1, high >= 0"
        )
    if cfg.dual_clip is not None and (name != "ppo" or cfg.dual_clip <= 1.0):
        raise ValueError(f"dual_clip={cfg.dual_clip} applies to ppo only and must be > 1")


def _zero_outside(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, values, torch.zeros_like(values))


def _ratio_metrics(
    log_ratio: Tensor, mask: Tensor, clipped: Tensor, **extra: Tensor
) -> dict[str, Tensor]:
    ratio = log_ratio.exp()
    metrics = {
        "loss/clip_frac": masked_mean(clipped.float(), mask),
        "loss/ratio_mean": masked_mean(ratio, mask),
        # k3 estimate of KL(pi_old || pi): ratio - 1 - log ratio, always >= 0.
        "loss/approx_kl": masked_mean(ratio - 1 - log_ratio, mask),
    }
    metrics.update({f"loss/{k}": v for k, v in extra.items()})
    return metrics


def ppo(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: LossConfig
) -> PolicyLoss:
    """PPO clipped surrogate, per token:
    L_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t), r_t = pi(y_t) / pi_old(y_t).
    Dual clip (c > 1): where A_t < 0, L_t = min(L_t, -c A_t), bounding the loss of tokens whose
    ratio has grown far past the clip range."""
    log_ratio = safe_log_ratio(logprobs, old_logprobs, mask)
    ratio = log_ratio.exp()
    advantages = advantages.float()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    dual_clipped = torch.zeros_like(mask)
    if cfg.dual_clip is not None:
        bound = -cfg.dual_clip * advantages
        dual_clipped = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    metrics = _ratio_metrics(
        log_ratio, mask, clipped < unclipped, dual_clip_frac=masked_mean(dual_clipped.float(), mask)
    )
    return PolicyLoss(_zero_outside(loss, mask), metrics)


def gspo(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: LossConfig
) -> PolicyLoss:
    """GSPO: a sequence-level ratio s_i = exp(mean_t log r_{i,t}) over a row's masked tokens,
    used per token as s_{i,t} = sg(s_i) * pi(y_t) / sg(pi(y_t)): its value is s_i and its
    gradient s_i * grad log pi(y_t). L_t = -min(s_{i,t} A_t, clip(s_{i,t}, 1 - low, 1 + high) A_t).
    The GSPO paper uses far tighter clip ranges than PPO (e.g. 3e-4 / 4e-4)."""
    log_ratio = safe_log_ratio(logprobs, old_logprobs, mask)
    tokens = mask.sum(-1, keepdim=True).clamp(min=1)
    seq_log_ratio = _zero_outside(log_ratio, mask).sum(-1, keepdim=True) / tokens
    # Value s_i, gradient s_i * grad log pi(y_t): the token's own log-ratio carries the gradient.
    token_log_ratio = seq_log_ratio.detach() + log_ratio - log_ratio.detach()
    ratio = _zero_outside(token_log_ratio, mask).exp()
    advantages = advantages.float()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return PolicyLoss(
        _zero_outside(loss, mask),
        _ratio_metrics(seq_log_ratio.expand_as(log_ratio), mask, clipped < unclipped),
    )


def cispo(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: LossConfig
) -> PolicyLoss:
    """CISPO: L_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * log pi(y_t).
    The importance weight is clipped and detached, so no token's gradient is dropped: a
    clipped token still contributes through log pi, with a bounded weight."""
    log_ratio = safe_log_ratio(logprobs, old_logprobs, mask)
    ratio = log_ratio.exp()
    weight = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high).detach()
    safe_logprobs = torch.nan_to_num(logprobs.float(), neginf=-LOG_RATIO_LIMIT)
    loss = -weight * advantages.float() * safe_logprobs
    clipped = weight != ratio.detach()
    return PolicyLoss(_zero_outside(loss, mask), _ratio_metrics(log_ratio, mask, clipped))


POLICY_LOSSES = {"ppo": ppo, "gspo": gspo, "cispo": cispo}
PolicyLossName = Literal["ppo", "gspo", "cispo"]  # the keys above, for typed configs
# The aggregation each loss's paper optimises: GSPO's objective is a mean over sequences.
LOSS_AGGREGATION = {"ppo": "token-mean", "gspo": "seq-mean-token-mean", "cispo": "token-mean"}


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None = 0.2
) -> PolicyLoss:
    """Clipped value loss, per token: V_clip = V_old + clip(V - V_old, -c, c),
    L_t = 0.5 * max((V - G)^2, (V_clip - G)^2); without `clip`, L_t = 0.5 * (V - G)^2.
    Metric `value/clip_frac`: tokens where the clipped term was the larger."""
    values, returns = values.float(), returns.float()
    loss = (values - returns) ** 2
    clipped_frac = torch.zeros((), device=values.device)
    if clip is not None:
        clipped_values = old_values.float() + (values - old_values.float()).clamp(-clip, clip)
        clipped_loss = (clipped_values - returns) ** 2
        clipped_frac = masked_mean((clipped_loss > loss).float(), mask)
        loss = torch.maximum(loss, clipped_loss)
    loss = _zero_outside(0.5 * loss, mask)
    metrics = {
        "value/clip_frac": clipped_frac,
        "value/error_mean": masked_mean((values - returns).abs(), mask),
        "value/mean": masked_mean(values, mask),
    }
    return PolicyLoss(loss, metrics)
