"""Policy and value losses: values against direct formulas, gradients, numerical safety."""

import math

import pytest
import torch

from molt_algos.aggregation import aggregate
from molt_algos.losses import (
    POLICY_LOSSES,
    LossConfig,
    cispo,
    gspo,
    ppo,
    validate_loss_config,
    value_loss,
)


def tokens(*values):
    return torch.tensor([list(values)], dtype=torch.float32)


def test_ppo_clips_per_side():
    cfg = LossConfig(clip_low=0.2, clip_high=0.28)
    old = torch.zeros(1, 4)
    logprobs = torch.log(tokens(1.5, 1.5, 0.5, 0.5))
    advantages = tokens(1.0, -1.0, 1.0, -1.0)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss = ppo(logprobs, old, advantages, mask, cfg)
    # A>0, r=1.5: min(1.5, 1.28) -> 1.28; A<0, r=1.5: min(-1.5, -1.28) -> -1.5
    # A>0, r=0.5: min(0.5, 0.8) -> 0.5;   A<0, r=0.5: min(-0.5, -0.8) -> -0.8
    torch.testing.assert_close(loss.per_token, -tokens(1.28, -1.5, 0.5, -0.8))
    assert loss.metrics["loss/clip_frac"] == pytest.approx(0.5)


def test_ppo_dual_clip_bounds_negative_advantage_loss():
    logprobs = torch.log(tokens(10.0, 10.0))
    loss = ppo(
        logprobs,
        torch.zeros(1, 2),
        tokens(-1.0, 1.0),
        torch.ones(1, 2, dtype=torch.bool),
        LossConfig(dual_clip=3.0),
    )
    # A=-1, r=10: PPO loss 10, bounded to 3; A>0 untouched (clipped at 1.2).
    torch.testing.assert_close(loss.per_token, tokens(3.0, -1.2))
    assert loss.metrics["loss/dual_clip_frac"] == pytest.approx(0.5)


def test_ppo_gradient_is_ratio_times_advantage_inside_clip():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.0]])
    adv = tokens(2.0, -1.0)
    per_token = ppo(logprobs, old, adv, torch.ones(1, 2, dtype=torch.bool), LossConfig()).per_token
    per_token.sum().backward()
    ratio = torch.exp(logprobs.detach() - old)
    torch.testing.assert_close(logprobs.grad, -ratio * adv)


def test_gspo_uses_sequence_ratio_value_and_token_gradient():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.1, -3.1], [-1.0, -1.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.ones(2, 3)
    cfg = LossConfig(clip_low=0.5, clip_high=0.5)
    per_token = gspo(logprobs, old, adv, mask, cfg).per_token
    seq_ratio = math.exp(0.1)  # geometric mean of the first row's token ratios
    torch.testing.assert_close(per_token[0], torch.full((3,), -seq_ratio))
    torch.testing.assert_close(per_token[1], torch.tensor([-1.0, -1.0, 0.0]))
    per_token.sum().backward()
    expected = torch.tensor([[-seq_ratio] * 3, [-1.0, -1.0, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)


def test_cispo_keeps_gradient_of_clipped_tokens():
    logprobs = torch.log(tokens(3.0, 1.0)).requires_grad_()
    adv = tokens(1.0, 1.0)
    loss = cispo(logprobs, torch.zeros(1, 2), adv, torch.ones(1, 2, dtype=torch.bool), LossConfig())
    torch.testing.assert_close(loss.per_token, -tokens(1.2, 1.0) * logprobs.detach())
    loss.per_token.sum().backward()
    torch.testing.assert_close(logprobs.grad, -tokens(1.2, 1.0))  # clipped weight, not zero
    assert loss.metrics["loss/clip_frac"] == pytest.approx(0.5)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_losses_are_safe_on_extreme_inputs(name):
    logprobs = torch.tensor(
        [[-float("inf"), 0.0, -1e4, float("nan")], [-1.0, -1.0, -1.0, -1.0]], requires_grad=True
    )
    old = torch.tensor([[0.0, -float("inf"), 0.0, -1.0], [-float("inf")] * 4])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0], [-1.0, 1.0, 1.0, 1.0]])
    loss = POLICY_LOSSES[name](logprobs, old, adv, mask, LossConfig())
    assert torch.all(torch.isfinite(loss.per_token))
    assert torch.all(loss.per_token[~mask] == 0)
    aggregate(loss.per_token, mask).backward()
    assert torch.all(torch.isfinite(logprobs.grad))
    assert all(math.isfinite(v) for v in loss.metrics.values())


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_all_masked_batch_gives_zero_loss_and_zero_gradient(name):
    logprobs = torch.randn(2, 5, requires_grad=True)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    per_token = POLICY_LOSSES[name](
        logprobs, torch.randn(2, 5), torch.randn(2, 5), mask, LossConfig()
    ).per_token
    total = aggregate(per_token, mask)
    total.backward()
    assert total.item() == 0.0
    assert torch.all(logprobs.grad == 0)


def test_value_loss_clipping():
    values = tokens(2.0, 0.5).requires_grad_()
    old = tokens(1.0, 1.0)
    returns = tokens(0.0, 0.0)
    mask = torch.ones(1, 2, dtype=torch.bool)
    result = value_loss(values, old, returns, mask, clip=0.2)
    # Token 0: unclipped (2-0)^2=4, clipped (1.2-0)^2=1.44 -> 4. Token 1: 0.25 vs (0.8)^2=0.64 -> 0.64.
    torch.testing.assert_close(result.per_token, 0.5 * tokens(4.0, 0.64))
    assert result.metrics["value/clip_frac"] == pytest.approx(0.5)
    result.per_token.sum().backward()
    torch.testing.assert_close(values.grad, tokens(2.0, 0.0))  # clipped branch has no gradient
    unclipped = value_loss(values, old, returns, mask, clip=None)
    torch.testing.assert_close(unclipped.per_token, 0.5 * tokens(4.0, 0.25))


def test_loss_config_validation():
    validate_loss_config("ppo", LossConfig(dual_clip=3.0))
    with pytest.raises(ValueError, match="unknown policy loss"):
        validate_loss_config("trpo", LossConfig())
    with pytest.raises(ValueError, match="dual_clip"):
        validate_loss_config("ppo", LossConfig(dual_clip=0.5))
    with pytest.raises(ValueError, match="dual_clip"):
        validate_loss_config("gspo", LossConfig(dual_clip=3.0))
    with pytest.raises(ValueError, match="clip_low"):
        validate_loss_config("ppo", LossConfig(clip_low=1.0))
