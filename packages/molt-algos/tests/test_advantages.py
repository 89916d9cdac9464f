"""Every estimator against a slow reference written with Python loops."""

import math
import statistics
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt_algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageBatch,
    AdvantageConfig,
    compute_advantages,
    validate_advantage_config,
)

# --- slow references ---------------------------------------------------------------------------


def rollouts_of(batch: AdvantageBatch):
    """rollout id -> (reward, group, [(row, t) action tokens in order])."""
    out = {}
    for row in range(len(batch.rewards)):
        rid = int(batch.rollout_ids[row])
        entry = out.setdefault(rid, (float(batch.rewards[row]), int(batch.group_ids[row]), []))
        for t in range(batch.action_mask.shape[1]):
            if batch.action_mask[row, t]:
                entry[2].append((row, t))
    return out


def group_rewards(rollouts):
    groups = {}
    for reward, group, _ in rollouts.values():
        groups.setdefault(group, []).append(reward)
    return groups


def ref_group_estimator(batch, name, eps):
    rollouts = rollouts_of(batch)
    groups = group_rewards(rollouts)
    everyone = [reward for reward, _, _ in rollouts.values()]
    out = torch.zeros(batch.action_mask.shape, dtype=torch.float64)
    for reward, group, tokens in rollouts.values():
        others = groups[group]
        n, mean = len(others), sum(others) / len(others)
        if name == "grpo":
            std = statistics.stdev(others) if n > 1 else 0.0
            adv = (reward - mean) / (std + eps)
        elif name == "dr_grpo":
            adv = reward - mean
        elif name == "rloo":
            adv = reward - (sum(others) - reward) / (n - 1) if n > 1 else 0.0
        elif name == "flash_reinforce":
            adv = reward - sum(everyone) / len(everyone)
        for row, t in tokens:
            out[row, t] = adv
    return out


def ref_whiten(values, mask, eps):
    selected = [float(values[r, t]) for r, t in mask.nonzero().tolist()]
    if not selected:
        return values
    mean = sum(selected) / len(selected)
    std = math.sqrt(sum((v - mean) ** 2 for v in selected) / len(selected))
    out = torch.zeros_like(values)
    for r, t in mask.nonzero().tolist():
        out[r, t] = (values[r, t] - mean) / (std + eps)
    return out


def ref_token_level(batch, name, cfg):
    """reinforce / reinforce_baseline / gae over each rollout's action tokens in order."""
    rollouts = rollouts_of(batch)
    groups = group_rewards(rollouts)
    adv = torch.zeros(batch.action_mask.shape, dtype=torch.float64)
    ret = torch.zeros_like(adv)
    for reward, group, tokens in rollouts.values():
        if name == "reinforce_baseline":
            reward = reward - sum(groups[group]) / len(groups[group])
        rewards = [-cfg.kl_coef * float(batch.kl[r, t]) for r, t in tokens]
        if tokens:
            rewards[-1] += reward
        if name == "gae":
            values = [float(batch.values[r, t]) for r, t in tokens] + [0.0]
            running = 0.0
            for i in reversed(range(len(tokens))):
                delta = rewards[i] + cfg.gamma * values[i + 1] - values[i]
                running = delta + cfg.gamma * cfg.lam * running
                adv[tokens[i]] = running
                ret[tokens[i]] = running + values[i]
        else:
            running = 0.0
            for i in reversed(range(len(tokens))):
                running = rewards[i] + cfg.gamma * running
                ret[tokens[i]] = running
                adv[tokens[i]] = running
    if cfg.whiten:
        adv = ref_whiten(adv, batch.action_mask, cfg.eps)
    return adv, ret


# --- comparisons -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "flash_reinforce"])
@pytest.mark.parametrize("seed", range(5))
def test_group_estimators_match_reference(batch_factory, name, seed):
    batch = batch_factory(seed, group_size=1 + seed % 4)  # includes singleton groups
    cfg = AdvantageConfig()
    result = compute_advantages(batch, replace(cfg, estimator=name))
    expected = ref_group_estimator(batch, name, cfg.eps)
    torch.testing.assert_close(result.advantages.double(), expected, rtol=1e-5, atol=1e-5)
    assert result.returns is None
    assert set(result.metrics) >= {"advantage/mean", "advantage/std"}


@pytest.mark.parametrize("name", ["reinforce", "reinforce_baseline", "gae"])
@pytest.mark.parametrize(
    "cfg",
    [
        AdvantageConfig(),
        AdvantageConfig(kl_coef=0.3, gamma=0.9, lam=0.8),
        AdvantageConfig(kl_coef=0.05, gamma=0.97, lam=0.95, whiten=False),
    ],
)
@pytest.mark.parametrize("seed", range(3))
def test_token_level_estimators_match_reference(batch_factory, name, cfg, seed):
    batch = batch_factory(seed)
    result = compute_advantages(batch, replace(cfg, estimator=name))
    expected_adv, expected_ret = ref_token_level(batch, name, cfg)
    torch.testing.assert_close(result.advantages.double(), expected_adv, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(result.returns.double(), expected_ret, rtol=1e-4, atol=1e-5)


def test_on_policy_distill_is_per_token_teacher_gap(batch_factory):
    batch = batch_factory(0)
    result = compute_advantages(
        batch, AdvantageConfig(estimator="on_policy_distill", distill_coef=0.5)
    )
    for r, t in torch.ones_like(batch.action_mask).nonzero().tolist():
        gap = float(batch.teacher_logprobs[r, t] - batch.logprobs[r, t])
        expected = 0.5 * gap if batch.action_mask[r, t] else 0.0
        assert math.isclose(float(result.advantages[r, t]), expected, rel_tol=1e-6, abs_tol=1e-7)


# --- edge cases --------------------------------------------------------------------------------


def one_row_per_rollout(rewards, groups, mask=None):
    rewards = torch.tensor(rewards, dtype=torch.float32)
    mask = torch.ones(len(rewards), 4, dtype=torch.bool) if mask is None else mask
    return AdvantageBatch(rewards, mask, torch.tensor(groups), torch.arange(len(rewards)))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_baseline"])
def test_constant_reward_group_has_zero_advantage(name):
    batch = one_row_per_rollout([1.0, 1.0, 1.0, 0.0, 1.0], [0, 0, 0, 1, 1])
    adv = compute_advantages(batch, AdvantageConfig(estimator=name, whiten=False)).advantages
    assert torch.all(adv[:3] == 0)
    assert torch.all(adv[3] < 0) and torch.all(adv[4] > 0)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_singleton_group_has_zero_advantage(name):
    batch = one_row_per_rollout([3.0, 1.0, 2.0], [0, 1, 1])
    adv = compute_advantages(batch, AdvantageConfig(estimator=name)).advantages
    assert torch.all(adv[0] == 0)
    assert torch.all(torch.isfinite(adv))


def test_flash_reinforce_centres_on_the_batch_with_one_rollout_per_prompt():
    batch = one_row_per_rollout([1.0, 0.0, 0.0, 1.0, 1.0], [0, 1, 2, 3, 4])
    result = compute_advantages(batch, AdvantageConfig(estimator="flash_reinforce"))
    expected = torch.tensor([0.4, -0.6, -0.6, 0.4, 0.4])[:, None].expand(5, 4)
    torch.testing.assert_close(result.advantages, expected)  # no std division, no whitening
    assert result.metrics["advantage/baseline"] == pytest.approx(0.6)
    constant = one_row_per_rollout([2.0, 2.0], [0, 1])
    flat = compute_advantages(constant, AdvantageConfig(estimator="flash_reinforce"))
    assert torch.all(flat.advantages == 0)


def test_flash_reinforce_counts_a_rollout_once_whatever_its_segments():
    batch = AdvantageBatch(
        rewards=torch.tensor([1.0, 1.0, 1.0, 0.0]),
        action_mask=torch.tensor([[1, 1], [1, 0], [0, 0], [1, 1]], dtype=torch.bool),
        group_ids=torch.tensor([0, 0, 0, 1]),
        rollout_ids=torch.tensor([3, 3, 3, 8]),
    )
    adv = compute_advantages(batch, AdvantageConfig(estimator="flash_reinforce")).advantages
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5], [0.5, 0.0], [0, 0], [-0.5, -0.5]]))


def test_multi_segment_rollout_counts_once_in_its_group():
    # Rollout 0 has three segments; a per-row mean would weigh it three times.
    batch = AdvantageBatch(
        rewards=torch.tensor([1.0, 1.0, 1.0, 0.0]),
        action_mask=torch.ones(4, 3, dtype=torch.bool),
        group_ids=torch.tensor([5, 5, 5, 5]),
        rollout_ids=torch.tensor([0, 0, 0, 1]),
    )
    adv = compute_advantages(batch, AdvantageConfig(estimator="dr_grpo")).advantages
    assert torch.allclose(adv[:3], torch.full((3, 3), 0.5))
    assert torch.allclose(adv[3], torch.full((3,), -0.5))


def test_reward_reaches_earlier_segments_and_skips_masked_tokens():
    # One rollout, two segments, an interior masked gap (tool output) in the first.
    mask = torch.tensor([[1, 0, 0, 1], [0, 1, 1, 0]], dtype=torch.bool)
    batch = AdvantageBatch(
        rewards=torch.tensor([1.0, 1.0]),
        action_mask=mask,
        group_ids=torch.tensor([0, 0]),
        rollout_ids=torch.tensor([9, 9]),
        values=torch.zeros(2, 4),
    )
    result = compute_advantages(
        batch, AdvantageConfig(estimator="reinforce", gamma=0.5, whiten=False)
    )
    # Action tokens in order: (0,0) (0,3) (1,1) (1,2); reward on the last, discount per action token.
    expected = torch.tensor([[0.125, 0, 0, 0.25], [0, 0.5, 1.0, 0]])
    torch.testing.assert_close(result.advantages, expected)
    gae = compute_advantages(
        batch, AdvantageConfig(estimator="gae", gamma=0.5, lam=1.0, whiten=False)
    )
    torch.testing.assert_close(gae.advantages, expected)


def test_all_masked_batch_is_finite():
    batch = one_row_per_rollout([1.0, 0.0], [0, 0], mask=torch.zeros(2, 4, dtype=torch.bool))
    batch.values = torch.zeros(2, 4)
    batch.logprobs = batch.teacher_logprobs = torch.zeros(2, 4)
    for name in ADVANTAGE_ESTIMATORS:
        result = compute_advantages(batch, AdvantageConfig(estimator=name))
        assert torch.all(result.advantages == 0), name
        assert all(math.isfinite(v) for v in result.metrics.values()), name


def test_segments_of_one_rollout_must_agree_on_reward():
    batch = AdvantageBatch(
        torch.tensor([1.0, 0.0]),
        torch.ones(2, 2, dtype=torch.bool),
        torch.tensor([0, 0]),
        torch.tensor([4, 4]),
    )
    with pytest.raises(ValueError, match="different rewards"):
        compute_advantages(batch, AdvantageConfig(estimator="grpo"))


# --- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["grpo", "dr_grpo", "rloo", "flash_reinforce", "on_policy_distill"]
)
def test_kl_in_reward_is_rejected_for_scalar_estimators(name):
    with pytest.raises(ValueError, match="kl_coef"):
        validate_advantage_config(AdvantageConfig(estimator=name, kl_coef=0.1))


def test_kl_in_reward_changes_token_level_advantages(batch_factory):
    batch = batch_factory(1)
    plain = compute_advantages(
        batch, AdvantageConfig(estimator="reinforce", whiten=False)
    ).advantages
    shaped = compute_advantages(
        batch, AdvantageConfig(estimator="reinforce", kl_coef=1.0, whiten=False)
    )
    assert not torch.allclose(plain, shaped.advantages)


def test_kl_coef_without_kl_tensor_fails():
    batch = one_row_per_rollout([1.0, 0.0], [0, 0])
    with pytest.raises(ValueError, match="no per-token kl"):
        compute_advantages(batch, AdvantageConfig(estimator="reinforce", kl_coef=0.1))


def test_unknown_estimator_and_bad_ranges():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        validate_advantage_config(AdvantageConfig(estimator="ppo"))
    with pytest.raises(ValueError, match="gamma"):
        validate_advantage_config(AdvantageConfig(estimator="gae", gamma=1.5))


@settings(max_examples=200, deadline=None)
@given(
    value=st.sampled_from([0.1, 0.98, 1 / 3, 0.7, -2.5, 1e-3, 123.456]),
    size=st.integers(2, 64),
    other=st.lists(st.floats(-1, 1, width=32), min_size=2, max_size=8),
)
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(value, size, other):
    """Float rounding of the group mean must not turn into advantage: 16 rewards of 0.98 once
    got -0.19 each under GRPO (mean rounded off 0.98, then the tiny std met eps)."""
    rewards = torch.tensor([value] * size + other, dtype=torch.float32)
    groups = torch.tensor([0] * size + [1] * len(other))
    batch = AdvantageBatch(
        rewards=rewards,
        action_mask=torch.ones(len(rewards), 3, dtype=torch.bool),
        group_ids=groups,
        rollout_ids=torch.arange(len(rewards)),
    )
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_baseline"):
        # reinforce_baseline's default batch whitening re-centres every token on the batch
        # mean; its group baseline itself is what must be exact.
        cfg = AdvantageConfig(estimator=name, whiten=False)
        advantages = compute_advantages(batch, cfg).advantages
        assert torch.equal(advantages[:size], torch.zeros(size, 3)), name
