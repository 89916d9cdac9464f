"""Length shaping of rollout rewards before advantages: ProRL's stop-properly penalty, then DAPO's
overlong ramp (docs/concepts/algorithms.md)."""

from dataclasses import dataclass

import torch
from torch import Tensor

from molt_algos.masked import to_floats


@dataclass
class RewardConfig:
    """Length shaping of rollout rewards, before advantages (`--reward.*`)."""

    overlong_buffer_len: int = 0  # DAPO: tokens before the budget where the penalty ramps; 0: off
    overlong_penalty_factor: float = 1.0  # DAPO: the penalty at the budget and beyond
    max_response_len: int | None = None  # DAPO's budget L; None: the rollout's token limit
    stop_properly_penalty_coef: float | None = None  # truncated: R*coef, coef<0: R=coef; None: off


@dataclass
class ShapedRewards:
    rewards: Tensor  # [R] the rewards advantages are computed from
    metrics: dict[str, float]


def validate_reward_config(cfg: RewardConfig) -> None:
    buffer, budget = cfg.overlong_buffer_len, cfg.max_response_len
    if buffer < 0 or cfg.overlong_penalty_factor < 0:
        factor = cfg.overlong_penalty_factor
        raise ValueError(f"overlong_buffer_len={buffer}, overlong_penalty_factor={factor}: >= 0")
    if buffer > 0 and (budget is None or buffer > budget):
        raise ValueError(f"overlong_buffer_len={buffer} must lie in (0, max_response_len={budget}]")
    coef = cfg.stop_properly_penalty_coef
    if coef is not None and coef > 1.0:
        raise ValueError(f"stop_properly_penalty_coef={coef} > 1 would reward truncation")


def overlong_penalty(lengths: Tensor, cfg: RewardConfig) -> Tensor:
    """DAPO's soft overlong punishment per rollout: factor * clip((L - C - |y|) / C, -1, 0)."""
    buffer, budget = cfg.overlong_buffer_len, cfg.max_response_len
    ramp = ((budget - buffer - lengths.float()) / buffer).clamp(-1.0, 0.0)
    return cfg.overlong_penalty_factor * ramp


def shape_rewards(
    rewards: Tensor, response_lengths: Tensor, truncated: Tensor, cfg: RewardConfig
) -> ShapedRewards:
    """Per rollout [R]: rewards, generated tokens (all turns and segments) and whether it was
    cut; `reward/*` metrics only with a rule on."""
    validate_reward_config(cfg)
    raw = shaped = rewards.float()
    coef = cfg.stop_properly_penalty_coef
    if cfg.overlong_buffer_len <= 0 and coef is None:
        return ShapedRewards(raw, {})
    cut = truncated.bool() if coef is not None else torch.zeros_like(truncated, dtype=torch.bool)
    if coef is not None:
        shaped = torch.where(cut, raw * coef if coef >= 0 else torch.full_like(raw, coef), raw)
    penalty = torch.zeros_like(raw)
    if cfg.overlong_buffer_len > 0:
        penalty = overlong_penalty(response_lengths, cfg)
        shaped = shaped + penalty

    def mean(x: Tensor) -> Tensor:
        return x.float().mean() if x.numel() else x.float().sum()

    means = {"raw_mean": raw, "shaped_mean": shaped, "overlong_penalty_mean": penalty}
    means |= {"overlong_frac": penalty < 0, "truncated_frac": cut}
    return ShapedRewards(shaped, to_floats({f"reward/{k}": mean(v) for k, v in means.items()}))
