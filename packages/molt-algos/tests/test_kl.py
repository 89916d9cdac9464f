import math

import pytest
import torch

from molt_algos.kl import KLController, kl_controller, kl_estimate


def test_estimators_match_formulas():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    r = logprobs - ref
    torch.testing.assert_close(kl_estimate(logprobs, ref, mask, "k1"), r)
    torch.testing.assert_close(kl_estimate(logprobs, ref, mask, "k2"), 0.5 * r**2)
    torch.testing.assert_close(kl_estimate(logprobs, ref, mask, "k3"), torch.exp(-r) - 1 + r)


def test_k1_k3_are_unbiased_for_true_kl():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=gen), 0)
    q = torch.softmax(torch.randn(6, generator=gen), 0)
    samples = torch.multinomial(p, 200_000, replacement=True, generator=gen)[None]
    mask = torch.ones_like(samples, dtype=torch.bool)
    true_kl = float((p * (p / q).log()).sum())
    for estimator in ("k1", "k3"):
        est = kl_estimate(p.log()[samples], q.log()[samples], mask, estimator).mean().item()
        assert est == pytest.approx(true_kl, abs=0.01), estimator


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_clamped_and_sanitised(estimator):
    logprobs = torch.tensor([[0.0, -float("inf"), float("nan"), -1.0]], requires_grad=True)
    ref = torch.tensor([[-float("inf"), 0.0, 0.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    kl = kl_estimate(logprobs, ref, mask, estimator)
    assert torch.all(torch.isfinite(kl)) and kl.abs().max() <= 10.0
    kl.sum().backward()
    assert torch.all(torch.isfinite(logprobs.grad))


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), "k4")


def test_adaptive_controller_moves_toward_target_and_round_trips():
    ctl = kl_controller(0.1, target=0.05, horizon=100)
    assert ctl.target == 0.05
    ctl.update(observed_kl=0.5, num_samples=10)  # far above target: error clipped at +0.2
    assert ctl.coef == pytest.approx(0.1 * 1.02)
    ctl.update(observed_kl=0.0, num_samples=10)  # below target: error -0.2
    assert ctl.coef == pytest.approx(0.1 * 1.02 * 0.98)
    restored = kl_controller(1.0, target=1.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored == ctl


def test_fixed_controller():
    ctl = kl_controller(0.2)
    assert ctl.target is None
    ctl.update(5.0, 100)
    assert ctl.coef == 0.2
    other = KLController(0.0)
    other.load_state_dict(ctl.state_dict())
    assert other.coef == 0.2
    with pytest.raises(ValueError):
        kl_controller(0.1, target=-1.0)
    assert math.isfinite(ctl.coef)
