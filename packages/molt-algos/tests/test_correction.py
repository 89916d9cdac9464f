"""IS correction truth tables for every level x mode."""

import math

import pytest
import torch

from molt_algos.advantages import AdvantageConfig
from molt_algos.correction import (
    IS_LEVELS,
    IS_MODES,
    importance_correction,
    validate_is_correction,
)


def isc(level: str = "off", mode: str = "mask", threshold: float = 2.0) -> AdvantageConfig:
    return AdvantageConfig(
        is_correction_level=level, is_correction_mode=mode, is_correction_threshold=threshold
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
    out = importance_correction(OLD_LOGPROBS, ROLLOUT_LOGPROBS, MASK, isc(level, mode))
    torch.testing.assert_close(out.weights, weights)
    assert torch.equal(out.mask, keep)


def test_sequence_gates_reject_whole_rows():
    rho = torch.tensor([[3.0, 1.0, 1.0], [3.0, 3.0, 0.2], [1.2, 1.2, 1.0]])
    mask = torch.ones(3, 3, dtype=torch.bool)
    old = rho.log()
    zeros = torch.zeros(3, 3)
    seq = importance_correction(old, zeros, mask, isc("seq", "mask"))
    # products: 3.0 (out), 1.8 (in), 1.44 (in)
    assert seq.mask[:, 0].tolist() == [False, True, True]
    geo = importance_correction(old, zeros, mask, isc("geo", "mask", 1.3))
    # geometric means: 1.442 (out), 1.216 (in), 1.129 (in)
    assert geo.mask[:, 0].tolist() == [False, True, True]
    torch.testing.assert_close(geo.weights[1], rho[1])  # kept rows keep per-token weights
    assert geo.metrics["is/filter_ratio"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("level", ["seq", "geo"])
@pytest.mark.parametrize("mode", ["clip", "trunc"])
def test_sequence_levels_reject_clip_and_trunc(level, mode):
    with pytest.raises(ValueError, match="rejection gate"):
        validate_is_correction(isc(level, mode))


def test_every_level_and_mode_is_covered():
    valid = {
        (lv, md) for lv in IS_LEVELS for md in IS_MODES if lv not in ("seq", "geo") or md == "mask"
    }
    assert valid == set(TRUTH)


def test_bad_band_and_names():
    for cfg in [
        isc("token", "mask", 1.0),
        isc("token", "mask", 0.9),
        isc("tok", "mask"),
        isc("token", "drop"),
    ]:
        with pytest.raises(ValueError):
            validate_is_correction(cfg)


def test_metrics_and_weights_are_safe():
    rollout = torch.tensor([[-1.0, -float("inf"), -3.0, float("nan")]])
    old = torch.tensor([[-1.5, -1.0, -float("inf"), -1.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    out = importance_correction(old, rollout, mask, isc("token", "trunc"))
    assert torch.all(torch.isfinite(out.weights))
    assert all(math.isfinite(v) for v in out.metrics.values())
    assert not out.weights.requires_grad


def test_vllm_kl_is_k1_of_rollout_against_recomputed():
    rollout = torch.tensor([[-1.0, -2.0, -9.0]])
    old = torch.tensor([[-1.2, -1.9, 0.0]])
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    out = importance_correction(old, rollout, mask, isc())
    assert out.metrics["is/vllm_kl"] == pytest.approx(((-1.0 + 1.2) + (-2.0 + 1.9)) / 2)
    assert out.metrics["is/ratio_min"] == pytest.approx(math.exp(-0.2))
    assert out.metrics["is/ratio_max"] == pytest.approx(math.exp(0.1))
    assert out.metrics["is/filter_ratio"] == 0.0
