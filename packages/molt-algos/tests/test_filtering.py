import itertools
import math

import pytest
import torch

from molt_algos.filtering import dynamic_group_filter, mean_pass_at_k, pass_at_k


def test_group_filter_keeps_mixed_groups_only():
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([3, 3, 5, 5, 9, 9, 1, 1])
    out = dynamic_group_filter(scores, groups)
    assert out.keep.tolist() == [False, False, False, False, True, True, False, False]
    assert out.kept_groups.tolist() == [9]
    assert out.metrics == {
        "filter/pass_rate": pytest.approx(5 / 8),
        "filter/all_pass_frac": pytest.approx(2 / 4),
        "filter/all_fail_frac": pytest.approx(1 / 4),
        "filter/kept_frac": pytest.approx(1 / 4),
    }


def test_group_filter_band_is_strict():
    scores = torch.tensor([0.25, 0.25, 0.5, 0.75])
    groups = torch.tensor([0, 0, 1, 1])
    assert dynamic_group_filter(scores, groups, low=0.25, high=0.75).keep.tolist() == [
        False,
        False,
        True,
        True,
    ]


def brute_force_pass_at_k(n, c, k):
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_is_not_max_over_samples():
    # Max-over-samples would call this 1.0.
    assert pass_at_k(10, 1, 1) == pytest.approx(0.1)
    assert math.isclose(pass_at_k(1000, 3, 100), 1 - math.comb(997, 100) / math.comb(1000, 100))


def test_pass_at_k_input_checks_and_mean():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    assert mean_pass_at_k([[True, False], [False, False]], 1) == pytest.approx(0.25)
    assert mean_pass_at_k([], 1) == 0.0
