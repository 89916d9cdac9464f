"""IS correction truth tables for every level x mode."""

import math

import pytest
import torch

from molt_algos.advantages import AdvantageConfig
from molt_algos.correction import (
    IS_LEVELS,
    IS_MODES,
    importance_correction,
    importance_weights,
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
    # the trainer's form (no metrics, no host read) weights alike
    alone = importance_weights(OLD_LOGPROBS, ROLLOUT_LOGPROBS, MASK, isc(level, mode))
    assert torch.equal(alone, out.weights)


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


# --- sequence gating by binary KL / total variation ---------------------------------------------


def gate(gating: str, threshold: float) -> AdvantageConfig:
    return AdvantageConfig(
        is_correction_level="seq",
        is_correction_mode="mask",
        is_correction_gating=gating,
        is_correction_threshold=threshold,
    )


def ref_row_divergence(old, rollout, mask, kind):
    """Per row, the mean over masked tokens of the sampled-token divergence, with plain math."""
    out = []
    for b in range(mask.shape[0]):
        values = []
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                continue
            p, q = math.exp(float(old[b, t])), math.exp(float(rollout[b, t]))
            if kind == "tv":
                values.append(abs(p - q))
            else:
                p, q = min(max(p, 1e-6), 1 - 1e-6), min(max(q, 1e-6), 1 - 1e-6)
                kl = q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
                values.append(max(kl, 0.0))
        out.append(sum(values) / len(values) if values else 0.0)
    return out


@pytest.mark.parametrize("kind,threshold", [("binary_kl", 0.02), ("tv", 0.08)])
@pytest.mark.parametrize("seed", range(4))
def test_divergence_gates_match_the_loop_reference(kind, threshold, seed):
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(12, 7, generator=gen) * 3
    old = (rollout + torch.randn(12, 7, generator=gen) * 0.3 * (seed + 1) / 2).clamp(max=0)
    mask = torch.rand(12, 7, generator=gen) < 0.7
    mask[0] = False
    out = importance_correction(old, rollout, mask, gate(kind, threshold))
    means = ref_row_divergence(old, rollout, mask, kind)
    rho = (old - rollout).exp()
    for b, mean in enumerate(means):
        kept = mean <= threshold
        assert torch.equal(out.mask[b], mask[b] & kept), (b, mean)
        expected = torch.where(mask[b] & kept, rho[b], torch.zeros_like(rho[b]))
        torch.testing.assert_close(out.weights[b], expected)  # survivors keep rho_t
    assert torch.equal(importance_weights(old, rollout, mask, gate(kind, threshold)), out.weights)
    nonempty = [m for b, m in enumerate(means) if mask[b].any()]
    assert out.metrics[f"is/seq_{kind}_mean"] == pytest.approx(sum(nonempty) / len(nonempty))
    assert out.metrics[f"is/seq_{kind}_max"] == pytest.approx(max(nonempty))


def test_divergence_gates_on_a_known_example():
    # Row 0: p = q everywhere (divergence 0). Row 1: p = 0.9 vs q = 0.5 on one of two tokens.
    old = torch.tensor([[0.5, 0.2], [0.9, 0.3]]).log()
    rollout = torch.tensor([[0.5, 0.2], [0.5, 0.3]]).log()
    mask = torch.ones(2, 2, dtype=torch.bool)
    tv = importance_correction(old, rollout, mask, gate("tv", 0.1))
    assert tv.mask.tolist() == [[True, True], [False, False]]  # row 1: mean TV 0.2
    assert importance_correction(old, rollout, mask, gate("tv", 0.25)).mask.all()
    kl = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # 0.511
    out = importance_correction(old, rollout, mask, gate("binary_kl", kl / 2 + 1e-4))
    assert out.mask.all()
    out = importance_correction(old, rollout, mask, gate("binary_kl", kl / 2 - 1e-4))
    assert out.mask[1].tolist() == [False, False] and out.metrics["is/filter_ratio"] == 0.5


def test_divergence_gates_are_safe_on_extreme_log_probs():
    old = torch.tensor([[-float("inf"), 0.0, float("nan"), -1.0]])
    rollout = torch.tensor([[-1.0, -float("inf"), -2.0, 0.5]])
    mask = torch.tensor([[1, 1, 1, 1]], dtype=torch.bool)
    for kind, threshold in [("binary_kl", 50.0), ("tv", 0.99)]:
        out = importance_correction(old, rollout, mask, gate(kind, threshold))
        assert torch.all(torch.isfinite(out.weights))
        assert all(math.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize(
    "cfg",
    [
        AdvantageConfig(is_correction_level="geo", is_correction_mode="mask",
                        is_correction_gating="tv", is_correction_threshold=0.1),
        AdvantageConfig(is_correction_level="token", is_correction_gating="binary_kl",
                        is_correction_threshold=0.1),
        gate("tv", 1.0),
        gate("tv", 2.0),
        gate("binary_kl", 0.0),
        gate("hellinger", 0.1),
    ],
)  # fmt: skip
def test_divergence_gate_settings_are_checked(cfg):
    with pytest.raises(ValueError):
        validate_is_correction(cfg)
