"""Length shaping: rollout rewards rewritten by response length before advantages.

Two rules, both per rollout (one scalar each), applied in this order:
  stop-properly (ProRL)  a truncated rollout (cut by a token or context limit rather than
                         finished) gets coef * R for coef in [0, 1], or the fixed reward coef
                         when coef < 0
  overlong (DAPO)        with L = the response budget and C = the buffer, add
                         factor * clip((L - C - |y|) / C, -1, 0): nothing up to L - C tokens,
                         a linear ramp inside the last C tokens, -factor at L and beyond
Formulas and sources: docs/algorithms.md. Settings: `RewardConfig` (`--reward.*`).
"""

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
    """Raise ValueError on settings the rules cannot honour (the budget must be known when the
    overlong penalty is on)."""
    if cfg.overlong_buffer_len < 0 or cfg.overlong_penalty_factor < 0:
        raise ValueError(
            f"overlong_buffer_len={cfg.overlong_buffer_len} and overlong_penalty_factor="
            f"{cfg.overlong_penalty_factor} must be >= 0"
        )
    if cfg.overlong_buffer_len > 0:
        if cfg.max_response_len is None:
            raise ValueError("the overlong penalty needs the response budget max_response_len")
        if not 0 < cfg.overlong_buffer_len <= cfg.max_response_len:
            raise ValueError(
                f"overlong_buffer_len={cfg.overlong_buffer_len} must lie in (0, "
                f"max_response_len={cfg.max_response_len}]"
            )
    coef = cfg.stop_properly_penalty_coef
    if coef is not None and coef > 1.0:
        raise ValueError(
            f"stop_properly_penalty_coef={coef}: in [0, 1] it scales a truncated rollout's "
            "reward, below 0 it is that reward; above 1 would reward truncation"
        )


def shaping_enabled(cfg: RewardConfig) -> bool:
    return cfg.overlong_buffer_len > 0 or cfg.stop_properly_penalty_coef is not None


def overlong_penalty(lengths: Tensor, max_len: int, buffer_len: int, factor: float) -> Tensor:
    """DAPO's soft overlong punishment per rollout: factor * clip((L - C - |y|) / C, -1, 0)."""
    if buffer_len <= 0:
        raise ValueError(f"buffer_len={buffer_len} must be > 0")
    expected = max_len - buffer_len
    return factor * ((expected - lengths.float()) / buffer_len).clamp(-1.0, 0.0)


def stop_properly(rewards: Tensor, truncated: Tensor, coef: float) -> Tensor:
    """ProRL's stop-properly penalty: truncated rollouts get coef * R (coef in [0, 1]) or the
    fixed reward coef (coef < 0); finished ones keep R."""
    shaped = rewards.float() * coef if coef >= 0 else torch.full_like(rewards.float(), coef)
    return torch.where(truncated, shaped, rewards.float())


def shape_rewards(
    rewards: Tensor, response_lengths: Tensor, truncated: Tensor, cfg: RewardConfig
) -> ShapedRewards:
    """Per rollout [R]: rewards, generated tokens (all turns and segments) and whether it was
    cut. Metrics (`reward/*`, only with a rule on): `reward/raw_mean`, `reward/shaped_mean`,
    `reward/overlong_penalty_mean`, `reward/overlong_frac` (rollouts the penalty reached),
    `reward/truncated_frac` (rollouts the stop-properly rule rewrote)."""
    validate_reward_config(cfg)
    raw = rewards.float()
    if not shaping_enabled(cfg):
        return ShapedRewards(raw, {})
    shaped = raw
    truncated = truncated.bool()
    if cfg.stop_properly_penalty_coef is not None:
        shaped = stop_properly(shaped, truncated, cfg.stop_properly_penalty_coef)
    penalty = torch.zeros_like(raw)
    if cfg.overlong_buffer_len > 0:
        penalty = overlong_penalty(
            response_lengths,
            cfg.max_response_len,
            cfg.overlong_buffer_len,
            cfg.overlong_penalty_factor,
        )
        shaped = shaped + penalty
    cut = truncated if cfg.stop_properly_penalty_coef is not None else torch.zeros_like(truncated)

    def mean(x: Tensor) -> Tensor:
        return x.float().mean() if x.numel() else x.float().sum()

    metrics = {
        "reward/raw_mean": mean(raw),
        "reward/shaped_mean": mean(shaped),
        "reward/overlong_penalty_mean": mean(penalty),
        "reward/overlong_frac": mean(penalty < 0),
        "reward/truncated_frac": mean(cut),
    }
    return ShapedRewards(shaped, to_floats(metrics))
