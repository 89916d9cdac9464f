"""The asynchronous-use correction: train/rollout importance sampling.

Importance sampling. The settings are `AdvantageConfig.is_correction_*` (one owner of the
`--algo.advantage.*` flags); the band is [1/threshold, threshold]. The engine samples with pi_rollout (vLLM's kernels, possibly older
weights); the trainer recomputes pi_old with its own kernels at the same weights version it
trains from. Per token rho_t = pi_old(y_t) / pi_rollout(y_t). `level` says what is compared
with the band [low, high]:
  off    nothing is corrected (weights 1); the mismatch is still measured
  token  rho_t per token
  seq    the sequence ratio prod_t rho_t (a row's masked tokens)
  geo    its geometric mean exp(mean_t log rho_t), length-independent
and `mode` what happens outside the band:
  mask   out-of-band tokens (token) or whole rows (seq, geo) are dropped; kept tokens carry rho_t
  clip   w_t = clip(rho_t, low, high), nothing dropped            (token level only)
  trunc  w_t = min(rho_t, high), nothing dropped, `low` unused    (token level only)
seq and geo are rejection gates: they only drop, and the kept rows' tokens keep their per-token
weight rho_t. The returned `weights` multiply the per-token policy loss; the returned `mask`
replaces the loss mask (so dropped tokens leave the token-mean denominator too).
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from molt_algos.advantages import AdvantageConfig
from molt_algos.masked import masked_mean, masked_min_max, masked_sum, safe_log_ratio, to_floats

IS_LEVELS = ("off", "token", "seq", "geo")
IS_MODES = ("mask", "clip", "trunc")


@dataclass
class Correction:
    weights: Tensor  # [B, T] per-token loss weights (detached), 0 where dropped
    mask: Tensor  # [B, T] bool: the loss mask after dropping
    metrics: dict[str, float]


def validate_is_correction(cfg: AdvantageConfig) -> None:
    level, mode = cfg.is_correction_level, cfg.is_correction_mode
    if level not in IS_LEVELS or mode not in IS_MODES:
        raise ValueError(
            f"IS correction level={level!r} mode={mode!r}: level must be one of {IS_LEVELS}, "
            f"mode one of {IS_MODES}"
        )
    if level in ("seq", "geo") and mode != "mask":
        raise ValueError(
            f"IS correction level={level!r} is a rejection gate: it supports mode 'mask' only, "
            f"not {mode!r}"
        )
    if not cfg.is_correction_threshold > 1.0:
        raise ValueError(
            f"IS correction threshold={cfg.is_correction_threshold} must be > 1 (the band is "
            "[1/threshold, threshold])"
        )


def importance_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    cfg: AdvantageConfig,
    version_match: Tensor | None = None,
) -> Correction:
    """Per-token weights and the kept mask for the train/rollout mismatch (see module doc).

    Metrics (docs/algorithms.md): `is/off_policy_kl`, the k1 estimate of KL(pi_rollout ||
    pi_old) = mean of log pi_rollout - log pi_old over masked tokens: the engine/trainer
    mismatch plus the policy change since older versions sampled; `is/vllm_kl`, the same over
    the tokens of `version_match` (sampled by exactly the weights being trained: the mismatch
    alone; all masked tokens when None; NaN when there are none); `is/filter_ratio` (fraction
    of masked tokens dropped); `is/ratio_min/mean/max` (rho_t over masked tokens, unclipped)."""
    validate_is_correction(cfg)
    level, mode = cfg.is_correction_level, cfg.is_correction_mode
    log_rho = safe_log_ratio(old_logprobs, rollout_logprobs, mask).detach()
    rho = log_rho.exp()
    high = cfg.is_correction_threshold
    low = 1.0 / high

    keep = mask
    weights = rho
    if level == "off":
        weights = torch.ones_like(rho)
    elif level == "token" and mode == "mask":
        keep = mask & (rho >= low) & (rho <= high)
    elif level == "token" and mode == "clip":
        weights = rho.clamp(low, high)
    elif level == "token" and mode == "trunc":
        weights = rho.clamp(max=high)
    else:  # seq / geo rejection gate; log-space comparison so long sequences cannot overflow
        row_log_rho = torch.where(mask, log_rho, torch.zeros_like(log_rho)).sum(-1)
        if level == "geo":
            row_log_rho = row_log_rho / mask.sum(-1).clamp(min=1)
        inside = (row_log_rho >= math.log(low)) & (row_log_rho <= math.log(high))
        keep = mask & inside[:, None]

    weights = torch.where(keep, weights, torch.zeros_like(weights))
    ratio_min, ratio_max = masked_min_max(rho, mask)
    dropped = masked_sum((mask & ~keep).float(), mask) / mask.sum().clamp(min=1)
    current = mask if version_match is None else mask & version_match
    mismatch = masked_mean(-log_rho, current) if current.any() else math.nan
    metrics = to_floats(
        {
            "is/vllm_kl": mismatch,
            "is/off_policy_kl": masked_mean(-log_rho, mask),
            "is/filter_ratio": dropped,
            "is/ratio_min": ratio_min,
            "is/ratio_mean": masked_mean(rho, mask),
            "is/ratio_max": ratio_max,
        }
    )
    return Correction(weights, keep, metrics)
