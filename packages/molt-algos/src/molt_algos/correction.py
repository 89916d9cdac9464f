"""Train/rollout importance sampling, rho_t = pi_old(y_t) / pi_rollout(y_t): the engine samples
with its own kernels and maybe older weights. Levels, modes, gates: docs/concepts/algorithms.md."""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from molt_algos.advantages import AdvantageConfig
from molt_algos.masked import (
    LOG_RATIO_LIMIT,
    masked_mean,
    masked_min_max,
    row_sums,
    safe_log_ratio,
    to_floats,
)

IS_LEVELS = ("off", "token", "seq", "geo")
IS_MODES = ("mask", "clip", "trunc")
IS_GATINGS = ("ratio", "binary_kl", "tv")
PROB_EPS = 1e-6  # probabilities kept inside [eps, 1 - eps] in the binary KL's logarithms


@dataclass
class Correction:
    weights: Tensor  # [B, T] per-token loss weights (detached), 0 where dropped
    mask: Tensor  # [B, T] bool: the loss mask after dropping
    metrics: dict[str, float]


def validate_is_correction(cfg: AdvantageConfig) -> None:
    level, mode = cfg.is_correction_level, cfg.is_correction_mode
    gating, threshold = cfg.is_correction_gating, cfg.is_correction_threshold
    if level not in IS_LEVELS or mode not in IS_MODES or gating not in IS_GATINGS:
        choices = f"levels {IS_LEVELS}, modes {IS_MODES}, gatings {IS_GATINGS}"
        raise ValueError(f"IS correction {level!r} {mode!r} {gating!r}: choose of {choices}")
    if level in ("seq", "geo") and mode != "mask":
        raise ValueError(f"IS correction level={level!r} is a rejection gate: mode 'mask' only")
    if gating != "ratio" and level != "seq":
        raise ValueError(f"IS correction gating={gating!r} gates whole sequences: level 'seq'")
    if gating == "ratio" and not threshold > 1.0:
        raise ValueError(f"IS correction threshold={threshold} must be > 1 (band [1/t, t])")
    if gating == "binary_kl" and not threshold > 0.0:
        raise ValueError(f"IS correction threshold={threshold} must be > 0 (a binary KL bound)")
    if gating == "tv" and not 0.0 < threshold < 1.0:
        raise ValueError(f"IS correction threshold={threshold} must lie in (0, 1) (a TV bound)")


def importance_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cfg: AdvantageConfig
) -> Tensor:
    """The weights of `importance_correction` alone: no metrics, nothing read to the host."""
    return _weights(old_logprobs, rollout_logprobs, mask, cfg)[0]


def importance_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    cfg: AdvantageConfig,
    version_match: Tensor | None = None,
) -> Correction:
    """Weights, kept mask and the `is/*` metrics (docs/reference/metrics.md); `version_match`:
    the tokens sampled by the weights being trained, over which `is/vllm_kl` is measured."""
    weights, keep, log_rho, row_mean = _weights(old_logprobs, rollout_logprobs, mask, cfg)
    rho = log_rho.exp()
    ratio_min, ratio_max = masked_min_max(rho, mask)
    current = mask if version_match is None else mask & version_match
    metrics = {
        "is/vllm_kl": masked_mean(-log_rho, current) if current.any() else math.nan,
        "is/off_policy_kl": masked_mean(-log_rho, mask),
        "is/filter_ratio": masked_mean((~keep).float(), mask),
        "is/ratio_min": ratio_min,
        "is/ratio_mean": masked_mean(rho, mask),
        "is/ratio_max": ratio_max,
    }
    if row_mean is not None:
        rows, name = mask.any(-1), cfg.is_correction_gating
        metrics[f"is/seq_{name}_mean"] = masked_mean(row_mean, rows)
        metrics[f"is/seq_{name}_max"] = masked_min_max(row_mean, rows)[1]
    return Correction(weights, keep, to_floats(metrics))


def _weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cfg: AdvantageConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(weights, kept mask, log rho, the rows' mean divergence where a gate uses one)."""
    validate_is_correction(cfg)
    level, mode = cfg.is_correction_level, cfg.is_correction_mode
    log_rho = safe_log_ratio(old_logprobs, rollout_logprobs, mask).detach()
    rho = log_rho.exp()
    high, low = cfg.is_correction_threshold, 1.0 / cfg.is_correction_threshold
    keep, weights, row_mean = mask, rho, None
    if level == "off":
        weights = torch.ones_like(rho)
    elif level == "token" and mode == "mask":
        keep = mask & (rho >= low) & (rho <= high)
    elif level == "token":
        weights = rho.clamp(low, high) if mode == "clip" else rho.clamp(max=high)
    elif cfg.is_correction_gating == "ratio":  # seq / geo in log space: no overflow
        row_log_rho = row_sums(log_rho, mask)
        if level == "geo":
            row_log_rho = row_log_rho / mask.sum(-1).clamp(min=1)
        inside = (row_log_rho >= math.log(low)) & (row_log_rho <= math.log(high))
        keep = mask & inside[:, None]
    else:  # a seq gate on the row's mean binary KL or TV of the sampled tokens
        divergence = sampled_token_divergence(
            old_logprobs, rollout_logprobs, mask, cfg.is_correction_gating
        )
        row_mean = row_sums(divergence, mask) / mask.sum(-1).clamp(min=1)
        keep = mask & (row_mean <= cfg.is_correction_threshold)[:, None]
    return torch.where(keep, weights, torch.zeros_like(weights)), keep, log_rho, row_mean


def sampled_token_divergence(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, kind: str
) -> Tensor:
    """Per token, q = pi_rollout(y_t) against p = pi_old(y_t): `binary_kl` q log(q/p) + (1-q)
    log((1-q)/(1-p)), `tv` |p - q|; 0 outside `mask`, log-probs sanitised first (detached)."""
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
