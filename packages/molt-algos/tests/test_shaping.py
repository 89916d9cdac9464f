"""Length shaping against a plain-Python reference, edge cases and validation."""

import random

import pytest
import torch

from molt_algos.shaping import (
    RewardConfig,
    overlong_penalty,
    shape_rewards,
    validate_reward_config,
)


def ref_shape(reward, length, truncated, cfg):
    """One rollout, the rules as written in docs/concepts/algorithms.md."""
    coef = cfg.stop_properly_penalty_coef
    if coef is not None and truncated:
        reward = reward * coef if coef >= 0 else coef
    if cfg.overlong_buffer_len > 0:
        budget, buffer = cfg.max_response_len, cfg.overlong_buffer_len
        if length <= budget - buffer:
            penalty = 0.0
        elif length <= budget:
            penalty = (budget - buffer - length) / buffer
        else:
            penalty = -1.0
        reward = reward + cfg.overlong_penalty_factor * penalty
    return reward


CONFIGS = [
    RewardConfig(overlong_buffer_len=4, max_response_len=16),
    RewardConfig(overlong_buffer_len=16, max_response_len=16, overlong_penalty_factor=0.5),
    RewardConfig(stop_properly_penalty_coef=0.0),
    RewardConfig(stop_properly_penalty_coef=0.3),
    RewardConfig(stop_properly_penalty_coef=-1.0),
    RewardConfig(overlong_buffer_len=5, max_response_len=12, stop_properly_penalty_coef=0.5),
]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("seed", range(3))
def test_shaping_matches_the_reference(cfg, seed):
    rng = random.Random(seed)
    n = 40
    rewards = [rng.choice([0.0, 1.0, rng.uniform(-1, 2)]) for _ in range(n)]
    lengths = [rng.randint(0, 20) for _ in range(n)]
    truncated = [length >= 16 or rng.random() < 0.2 for length in lengths]
    out = shape_rewards(torch.tensor(rewards), torch.tensor(lengths), torch.tensor(truncated), cfg)
    expected = [ref_shape(*row, cfg) for row in zip(rewards, lengths, truncated, strict=True)]
    torch.testing.assert_close(out.rewards, torch.tensor(expected))
    assert out.metrics["reward/raw_mean"] == pytest.approx(sum(rewards) / n)
    assert out.metrics["reward/shaped_mean"] == pytest.approx(sum(expected) / n, rel=1e-5)
    if cfg.stop_properly_penalty_coef is not None:
        assert out.metrics["reward/truncated_frac"] == pytest.approx(sum(truncated) / n)


def test_overlong_penalty_ramp():
    lengths = torch.tensor([0, 8, 12, 13, 14, 16, 17, 100])
    cfg = RewardConfig(overlong_buffer_len=4, overlong_penalty_factor=2.0, max_response_len=16)
    got = overlong_penalty(lengths, cfg)
    torch.testing.assert_close(got, torch.tensor([0, 0, 0, -0.5, -1.0, -2.0, -2.0, -2.0]))


def test_off_by_default_and_empty_batches():
    rewards = torch.tensor([1.0, 0.0])
    out = shape_rewards(rewards, torch.tensor([3, 9]), torch.tensor([False, True]), RewardConfig())
    assert torch.equal(out.rewards, rewards) and out.metrics == {}
    cfg = RewardConfig(overlong_buffer_len=2, max_response_len=4, stop_properly_penalty_coef=0.0)
    empty = shape_rewards(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.bool), cfg)
    assert empty.rewards.numel() == 0 and all(v == 0.0 for v in empty.metrics.values())


@pytest.mark.parametrize(
    "cfg",
    [
        RewardConfig(overlong_buffer_len=4),  # no budget
        RewardConfig(overlong_buffer_len=-1, max_response_len=8),
        RewardConfig(overlong_buffer_len=9, max_response_len=8),
        RewardConfig(overlong_buffer_len=2, max_response_len=8, overlong_penalty_factor=-1),
        RewardConfig(stop_properly_penalty_coef=1.5),
    ],
)
def test_bad_settings(cfg):
    with pytest.raises(ValueError):
        validate_reward_config(cfg)
