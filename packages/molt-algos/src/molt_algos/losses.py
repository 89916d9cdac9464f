"""Policy losses by name in `POLICY_LOSSES`, and the value loss: per-token [B, T], 0 outside
`mask`, weighted by IS corrections and then reduced by molt_algos.aggregation."""

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
    metrics: dict[str, Tensor]  # device scalars: a trainer reads a whole step's at once


def validate_loss_config(name: str, cfg: LossConfig) -> None:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {sorted(POLICY_LOSSES)}")
    if cfg.clip_low < 0 or cfg.clip_high < 0 or cfg.clip_low >= 1:
        clips = f"clip_low={cfg.clip_low}, clip_high={cfg.clip_high}"
        raise ValueError(f"{clips}: need 0 <= low < 1, high >= 0")
    if cfg.dual_clip is not None and (name != "ppo" or cfg.dual_clip <= 1.0):
        raise ValueError(f"dual_clip={cfg.dual_clip} applies to ppo only and must be > 1")


def _zero_outside(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, values, torch.zeros_like(values))


def _clipped(ratio: Tensor, advantages: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """(-min(r A, clip(r, 1 - low, 1 + high) A), where the clipped term was the smaller)."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def _ratio_metrics(log_ratio: Tensor, mask: Tensor, clipped: Tensor, **extra) -> dict:
    ratio = log_ratio.exp()
    return {
        "loss/clip_frac": masked_mean(clipped.float(), mask),
        "loss/ratio_mean": masked_mean(ratio, mask),
        # k3 estimate of KL(pi_old || pi): ratio - 1 - log ratio, always >= 0.
        "loss/approx_kl": masked_mean(ratio - 1 - log_ratio, mask),
        **{f"loss/{k}": v for k, v in extra.items()},
    }


def ppo(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: LossConfig
) -> PolicyLoss:
    """PPO's clipped surrogate, r_t = pi(y_t) / pi_old(y_t). Dual clip c: where A_t < 0,
    L_t = min(L_t, -c A_t), bounding tokens whose ratio grew far past the clip range."""
    log_ratio = safe_log_ratio(logprobs, old_logprobs, mask)
    advantages = advantages.float()
    loss, clipped = _clipped(log_ratio.exp(), advantages, cfg)
    dual_clipped = torch.zeros_like(mask)
    if cfg.dual_clip is not None:
        bound = -cfg.dual_clip * advantages
        dual_clipped = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    dual_frac = masked_mean(dual_clipped.float(), mask)
    return PolicyLoss(
        _zero_outside(loss, mask),
        _ratio_metrics(log_ratio, mask, clipped, dual_clip_frac=dual_frac),
    )


def gspo(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: LossConfig
) -> PolicyLoss:
    """GSPO: the clipped surrogate of s_i = exp(mean_t log r_{i,t}), per token sg(s_i) * pi(y_t)
    / sg(pi(y_t)): value s_i, gradient s_i grad log pi(y_t). Clip far tighter than PPO (3e-4)."""
    log_ratio = safe_log_ratio(logprobs, old_logprobs, mask)
    # safe_log_ratio is 0 outside the mask: the row sums are over the row's tokens.
    seq_log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    token_log_ratio = seq_log_ratio.detach() + log_ratio - log_ratio.detach()
    loss, clipped = _clipped(_zero_outside(token_log_ratio, mask).exp(), advantages.float(), cfg)
    metrics = _ratio_metrics(seq_log_ratio.expand_as(log_ratio), mask, clipped)
    return PolicyLoss(_zero_outside(loss, mask), metrics)


def cispo(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: LossConfig
) -> PolicyLoss:
    """CISPO: L_t = -sg(clip(r_t, 1 - low, 1 + high)) * A_t * log pi(y_t): the weight is clipped
    and detached, so a clipped token still contributes, with a bounded weight."""
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
    """L_t = 0.5 * max((V - G)^2, (V_clip - G)^2), V_clip = V_old + clip(V - V_old, -c, c);
    0.5 * (V - G)^2 without `clip`. `value/clip_frac`: tokens where the clipped term won."""
    values, returns = values.float(), returns.float()
    loss = (values - returns) ** 2
    clipped_frac = torch.zeros((), device=values.device)
    if clip is not None:
        clipped_values = old_values.float() + (values - old_values.float()).clamp(-clip, clip)
        clipped_loss = (clipped_values - returns) ** 2
        clipped_frac = masked_mean((clipped_loss > loss).float(), mask)
        loss = torch.maximum(loss, clipped_loss)
    metrics = {
        "value/clip_frac": clipped_frac,
        "value/error_mean": masked_mean((values - returns).abs(), mask),
        "value/mean": masked_mean(values, mask),
    }
    return PolicyLoss(_zero_outside(0.5 * loss, mask), metrics)
