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
weight rho_t. `gating` says what a gate compares (level seq only for the last two):
  ratio      the sequence ratio (seq) or its geometric mean (geo) against the band
  binary_kl  the row's mean over tokens of KL(Bern(q_t) || Bern(p_t)), q_t = pi_rollout(y_t),
             p_t = pi_old(y_t): the two distributions collapsed to "this token or another"
  tv         the row's mean of |p_t - q_t|, the total variation of those two Bernoullis
and drops the row when its mean exceeds `threshold` (the ratio gate: when it leaves the band).
The returned `weights` multiply the per-token policy loss; the returned `mask` replaces the
loss mask (so dropped tokens leave the token-mean denominator too).
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from molt_algos.advantages import AdvantageConfig
from molt_algos.masked import (
    LOG_RATIO_LIMIT,
    masked_mean,
    masked_min_max,
    masked_sum,
    safe_log_ratio,
    to_floats,
)

IS_LEVELS = ("off", "token", "seq", "geo")
IS_MODES = ("mask", "clip", "trunc")
IS_GATINGS = ("ratio", "binary_kl", "tv")
# Probabilities are kept inside [PROB_EPS, 1 - PROB_EPS] in the binary KL's logarithms.
PROB_EPS = 1e-6


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
    gating, threshold = cfg.is_correction_gating, cfg.is_correction_threshold
    if gating not in IS_GATINGS:
        raise ValueError(f"IS correction gating={gating!r} must be one of {IS_GATINGS}")
    if gating != "ratio" and level != "seq":
        raise ValueError(
            f"IS correction gating={gating!r} gates whole sequences by their mean divergence: "
            f"it needs level 'seq', not {level!r}"
        )
    if gating == "ratio" and not threshold > 1.0:
        raise ValueError(
            f"IS correction threshold={threshold} must be > 1 (the band is "
            "[1/threshold, threshold])"
        )
    if gating == "binary_kl" and not threshold > 0.0:
        raise ValueError(f"IS correction threshold={threshold} must be > 0 (a binary KL bound)")
    if gating == "tv" and not 0.0 < threshold < 1.0:
        raise ValueError(
            f"IS correction threshold={threshold} must lie in (0, 1) (a total-variation bound; "
            "TV is at most 1)"
        )


def importance_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cfg: AdvantageConfig
) -> Tensor:
    """The per-token weights of `importance_correction` alone, for a trainer's loss: no
    metrics, so nothing is read back to the host in the middle of a step."""
    return _weights(old_logprobs, rollout_logprobs, mask, cfg)[0]


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
    weights, keep, log_rho, row_mean = _weights(old_logprobs, rollout_logprobs, mask, cfg)
    rho = log_rho.exp()
    gate_metrics: dict[str, Tensor] = {}
    if row_mean is not None:
        rows = mask.any(-1)
        name = cfg.is_correction_gating
        gate_metrics = {
            f"is/seq_{name}_mean": masked_mean(row_mean, rows),
            f"is/seq_{name}_max": masked_min_max(row_mean, rows)[1],
        }
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
            **gate_metrics,
        }
    )
    return Correction(weights, keep, metrics)


def _weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cfg: AdvantageConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(weights, kept mask, log rho, the rows' mean divergence where the sequence gate uses
    one)."""
    validate_is_correction(cfg)
    level, mode = cfg.is_correction_level, cfg.is_correction_mode
    log_rho = safe_log_ratio(old_logprobs, rollout_logprobs, mask).detach()
    rho = log_rho.exp()
    high = cfg.is_correction_threshold
    low = 1.0 / high
    keep, weights, row_mean = mask, rho, None
    if level == "off":
        weights = torch.ones_like(rho)
    elif level == "token" and mode == "mask":
        keep = mask & (rho >= low) & (rho <= high)
    elif level == "token" and mode == "clip":
        weights = rho.clamp(low, high)
    elif level == "token" and mode == "trunc":
        weights = rho.clamp(max=high)
    elif cfg.is_correction_gating == "ratio":  # seq / geo in log space: no overflow
        row_log_rho = torch.where(mask, log_rho, torch.zeros_like(log_rho)).sum(-1)
        if level == "geo":
            row_log_rho = row_log_rho / mask.sum(-1).clamp(min=1)
        inside = (row_log_rho >= math.log(low)) & (row_log_rho <= math.log(high))
        keep = mask & inside[:, None]
    else:  # seq gate on the row's mean binary KL or TV of the sampled tokens
        divergence = sampled_token_divergence(
            old_logprobs, rollout_logprobs, mask, cfg.is_correction_gating
        )
        row_mean = _row_means(divergence, mask)
        keep = mask & (row_mean <= cfg.is_correction_threshold)[:, None]
    return torch.where(keep, weights, torch.zeros_like(weights)), keep, log_rho, row_mean


def sampled_token_divergence(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, kind: str
) -> Tensor:
    """Per token, a divergence between pi_rollout and pi_old seen only through the sampled
    token: with q = pi_rollout(y_t) and p = pi_old(y_t), `binary_kl` is
    q log(q/p) + (1 - q) log((1 - q)/(1 - p)), `tv` is |p - q|. 0 outside `mask`; -inf, NaN
    and positive log-probs are sanitised first (detached)."""
    if kind not in ("binary_kl", "tv"):
        raise ValueError(f"unknown sampled-token divergence {kind!r}; use 'binary_kl' or 'tv'")
    log_p, log_q = _clean_logprobs(old_logprobs, mask), _clean_logprobs(rollout_logprobs, mask)
    p, q = log_p.exp(), log_q.exp()
    if kind == "tv":
        out = (p - q).abs()
    else:  # float64: the two terms nearly cancel for close p and q
        p, q = p.double().clamp(PROB_EPS, 1 - PROB_EPS), q.double().clamp(PROB_EPS, 1 - PROB_EPS)
        out = q * (q.log() - p.log()) + (1 - q) * (torch.log1p(-q) - torch.log1p(-p))
        out = out.clamp(min=0.0).float()  # >= 0 exactly; rounding can leave -1e-9
    return torch.where(mask, out, torch.zeros_like(out))


def _clean_logprobs(logprobs: Tensor, mask: Tensor) -> Tensor:
    clean = torch.nan_to_num(logprobs.detach().float(), nan=0.0, neginf=-LOG_RATIO_LIMIT)
    return torch.where(mask, clean.clamp(-LOG_RATIO_LIMIT, 0.0), torch.zeros_like(clean))


def _row_means(values: Tensor, mask: Tensor) -> Tensor:
    total = torch.where(mask, values, torch.zeros_like(values)).sum(-1)
    return total / mask.sum(-1).clamp(min=1)
