"""IS correction truth tables for every level x mode, and staleness masks."""

import math

import pytest
import torch

from molt_algos.correction import (
    IS_LEVELS,
    IS_MODES,
    ISConfig,
    importance_correction,
    staleness_mask,
    validate_is_config,
)

# Two rows of per-token ratios rho = pi_old / pi_rollout; band [0.5, 2.0].
RHO = torch.tensor([[0.25, 1.0, 4.0, 1.0], [1.0, 1.5, 1.0, 1.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
ROLLOUT_LOGPROBS = torch.full((2, 4), -2.0)
OLD_LOGPROBS = ROLLOUT_LOGPROBS + RHO.log()
M = MASK.float()

# (level, mode) -> (expected weights, expected kept mask)
TRUTH = {
    ("off", "mask"): (M, MASK),
    ("off", "clip"): (M, MASK),
    ("off", "trunc"): (M, MASK),
    ("token", "mask"): (
        torch.tensor([[0.0, 1.0, 0.0, 1.0], [1.0, 1.5, 1.0, 0.0]]),
        torch.tensor([[0, 1, 0, 1], [1, 1, 1, 0]], dtype=torch.bool),
    ),
    ("token", "clip"): (torch.tensor([[0.5, 1.0, 2.0, 1.0], [1.0, 1.5, 1.0, 0.0]]), MASK),
    ("token", "trunc"): (torch.tensor([[0.25, 1.0, 2.0, 1.0], [1.0, 1.5, 1.0, 0.0]]), MASK),
    # Row 0: product 1.0 (inside), geometric mean 1.0 (inside). Row 1: product 1.5, geo 1.5^(1/3).
    ("seq", "mask"): (RHO * M, MASK),
    ("geo", "mask"): (RHO * M, MASK),
}


@pytest.mark.parametrize("level,mode", sorted(TRUTH))
def test_truth_table(level, mode):
    weights, keep = TRUTH[(level, mode)]
    out = importance_correction(
        OLD_LOGPROBS, ROLLOUT_LOGPROBS, MASK, ISConfig(level, mode, 0.5, 2.0)
    )
    torch.testing.assert_close(out.weights, weights)
    assert torch.equal(out.mask, keep)


def test_sequence_gates_reject_whole_rows():
    rho = torch.tensor([[3.0, 1.0, 1.0], [3.0, 3.0, 0.2], [1.2, 1.2, 1.0]])
    mask = torch.ones(3, 3, dtype=torch.bool)
    old = rho.log()
    zeros = torch.zeros(3, 3)
    seq = importance_correction(old, zeros, mask, ISConfig("seq", "mask", 0.5, 2.0))
    # products: 3.0 (out), 1.8 (in), 1.44 (in)
    assert seq.mask[:, 0].tolist() == [False, True, True]
    geo = importance_correction(old, zeros, mask, ISConfig("geo", "mask", 0.5, 1.3))
    # geometric means: 1.442 (out), 1.216 (in), 1.129 (in)
    assert geo.mask[:, 0].tolist() == [False, True, True]
    torch.testing.assert_close(geo.weights[1], rho[1])  # kept rows keep per-token weights
    assert geo.metrics["is_filter_ratio"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("level", ["seq", "geo"])
@pytest.mark.parametrize("mode", ["clip", "trunc"])
def test_sequence_levels_reject_clip_and_trunc(level, mode):
    with pytest.raises(ValueError, match="rejection gate"):
        validate_is_config(ISConfig(level, mode))


def test_every_level_and_mode_is_covered():
    valid = {
        (lv, md) for lv in IS_LEVELS for md in IS_MODES if lv not in ("seq", "geo") or md == "mask"
    }
    assert valid == set(TRUTH)


def test_bad_band_and_names():
    for cfg in [
        ISConfig("token", "mask", 1.2, 2.0),
        ISConfig("token", "mask", 0.5, 0.9),
        ISConfig("tok", "mask"),
        ISConfig("token", "drop"),
    ]:
        with pytest.raises(ValueError):
            validate_is_config(cfg)


def test_metrics_and_weights_are_safe():
    rollout = torch.tensor([[-1.0, -float("inf"), -3.0, float("nan")]])
    old = torch.tensor([[-1.5, -1.0, -float("inf"), -1.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    out = importance_correction(old, rollout, mask, ISConfig("token", "trunc", 0.5, 2.0))
    assert torch.all(torch.isfinite(out.weights))
    assert all(math.isfinite(v) for v in out.metrics.values())
    assert not out.weights.requires_grad


def test_vllm_kl_is_k1_of_rollout_against_recomputed():
    rollout = torch.tensor([[-1.0, -2.0, -9.0]])
    old = torch.tensor([[-1.2, -1.9, 0.0]])
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    out = importance_correction(old, rollout, mask, ISConfig())
    assert out.metrics["vllm_kl"] == pytest.approx(((-1.0 + 1.2) + (-2.0 + 1.9)) / 2)
    assert out.metrics["is_ratio_min"] == pytest.approx(math.exp(-0.2))
    assert out.metrics["is_ratio_max"] == pytest.approx(math.exp(0.1))
    assert out.metrics["is_filter_ratio"] == 0.0


def test_staleness_token_and_sequence_drops():
    versions = torch.tensor([[5, 5, 3, 0], [4, 4, 4, 4], [1, 5, 5, 5]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    token = staleness_mask(versions, mask, current_version=5, max_staleness=1)
    assert token.mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 1]]
    seq = staleness_mask(versions, mask, current_version=5, max_staleness=1, drop="sequence")
    assert seq.mask.tolist() == [[0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 1]]
    assert token.metrics["staleness/lag_max"] == 2.0  # masked tokens only (the lag-5 one is not)
    assert token.metrics["staleness/dropped_frac"] == pytest.approx(1 / 10)
    assert seq.metrics["staleness/dropped_frac"] == pytest.approx(3 / 10)
    keep_all = staleness_mask(versions, mask, current_version=5, max_staleness=None)
    assert torch.equal(keep_all.mask, mask)
    assert keep_all.metrics["staleness/lag_mean"] == pytest.approx(
        sum([0, 0, 2, 1, 1, 1, 1, 0, 0, 0]) / 10
    )


def test_max_staleness_zero_keeps_only_current_version():
    versions = torch.tensor([[7, 6, 7]])
    out = staleness_mask(versions, torch.ones(1, 3, dtype=torch.bool), 7, 0)
    assert out.mask.tolist() == [[True, False, True]]
