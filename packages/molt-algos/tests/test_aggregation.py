"""Every aggregation mode against a loop reference, and the global-window contract:
microbatch accumulation and data-parallel splits give the full-batch gradient."""

import pytest
import torch

from molt_algos.aggregation import AGGREGATIONS, AggregationWindow, aggregate


def make_problem(seed=0, rows=8, length=10, groups=3):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(rows, length, 3, generator=gen)
    mask = torch.rand(rows, length, generator=gen) < 0.5
    mask[0] = False  # an empty row
    weight = torch.randn(3, generator=gen)
    # Unequal groups, their rows scattered (a group spans microbatches and ranks).
    group_ids = torch.randint(0, groups, (rows,), generator=gen) * 7 + 5
    return features, mask, weight, group_ids


def per_token_loss(weight, features):
    return (features @ weight).sin()


def reference(values, mask, group_ids, mode):
    """The mode's definition, one element at a time (autograd flows through the loop)."""
    rows, length = mask.shape
    kept = [[t for t in range(length) if mask[b, t]] for b in range(rows)]
    total = values.new_zeros(())
    if mode == "token-mean":
        n = sum(len(k) for k in kept)
        for b in range(rows):
            for t in kept[b]:
                total = total + values[b, t] / n
    elif mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        s = sum(1 for k in kept if k)
        for b in range(rows):
            for t in kept[b]:
                scale = len(kept[b]) if mode == "seq-mean-token-mean" else 1
                total = total + values[b, t] / scale / s
    elif mode == "prompt-mean-token-mean":
        groups: dict[int, list[int]] = {}
        for b in range(rows):
            groups.setdefault(int(group_ids[b]), []).append(b)
        nonempty = [g for g in groups.values() if sum(len(kept[b]) for b in g)]
        for members in nonempty:
            n_g = sum(len(kept[b]) for b in members)
            for b in members:
                for t in kept[b]:
                    total = total + values[b, t] / n_g / len(nonempty)
    else:
        raise AssertionError(mode)
    return total


def window_of(mask, group_ids):
    """The window's global counts, as the trainer computes them before the first microbatch."""
    tokens = mask.sum(-1)
    per_group = {int(g): int(tokens[group_ids == g].sum()) for g in group_ids.unique()}
    return dict(
        num_tokens=int(tokens.sum()),
        num_sequences=int((tokens > 0).sum()),
        num_groups=sum(1 for n in per_group.values() if n),
        group_tokens=torch.tensor([per_group[int(g)] for g in group_ids]),
    )


def grad_of(fn, weight):
    w = weight.clone().requires_grad_()
    fn(w).backward()
    return w.grad


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
@pytest.mark.parametrize("seed", range(4))
def test_full_batch_matches_loop_reference(mode, seed):
    features, mask, weight, groups = make_problem(seed, rows=6 + seed, groups=1 + seed)
    local = AggregationWindow(**window_of(mask, groups))
    got = aggregate(per_token_loss(weight, features), mask, mode, window=local)
    want = reference(per_token_loss(weight, features), mask, groups, mode)
    torch.testing.assert_close(got, want)
    g_got = grad_of(
        lambda w: aggregate(per_token_loss(w, features), mask, mode, window=local), weight
    )
    g_want = grad_of(lambda w: reference(per_token_loss(w, features), mask, groups, mode), weight)
    torch.testing.assert_close(g_got, g_want)


def accumulated_grad(features, mask, weight, groups, mode, dp_size, microbatches):
    """Simulated ranks each accumulate microbatches with the window's global counts; the
    data-parallel reduction then *averages* the ranks' gradients, as FSDP does."""
    counts = window_of(mask, groups)
    rank_grads = []
    for rank_rows in torch.arange(len(features)).chunk(dp_size):
        w = weight.clone().requires_grad_()
        for rows in rank_rows.chunk(microbatches):
            window = AggregationWindow(**{**counts, "group_tokens": counts["group_tokens"][rows]})
            loss = aggregate(
                per_token_loss(w, features[rows]), mask[rows], mode, dp_size=dp_size, window=window
            )
            loss.backward()
        rank_grads.append(w.grad)
    return torch.stack(rank_grads).mean(0)


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
@pytest.mark.parametrize("dp_size,microbatches", [(1, 1), (1, 4), (2, 2), (4, 1), (2, 3)])
def test_accumulation_and_dp_split_match_the_reference(mode, dp_size, microbatches):
    features, mask, weight, groups = make_problem(seed=dp_size * 10 + microbatches)
    expected = grad_of(lambda w: reference(per_token_loss(w, features), mask, groups, mode), weight)
    got = accumulated_grad(features, mask, weight, groups, mode, dp_size, microbatches)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_counts_left_none_are_the_calls_own():
    features, mask, weight, groups = make_problem(seed=5)
    values = per_token_loss(weight, features)
    counts = window_of(mask, groups)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        window = AggregationWindow(counts["num_tokens"], counts["num_sequences"])
        assert aggregate(values, mask, mode) == aggregate(values, mask, mode, window=window)


def test_local_mean_per_microbatch_would_differ():
    # The reason for the global denominator: averaging microbatch means is not the token mean.
    features, mask, weight, _ = make_problem(seed=3)
    values = per_token_loss(weight, features)
    halves = [aggregate(values[r], mask[r]) for r in torch.arange(8).chunk(2)]
    assert not torch.isclose(sum(halves) / 2, aggregate(values, mask))


def test_modes_on_a_known_example():
    values = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0], [6.0, 6.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    groups = AggregationWindow(**window_of(mask, torch.tensor([0, 0, 1])))
    assert aggregate(values, mask, "token-mean").item() == pytest.approx(24 / 6)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 2 + 6) / 3)
    assert aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx(24 / 3)
    # Group 0: (1 + 3 + 2) / 3 tokens = 2; group 1: 6. The long group does not dominate.
    got = aggregate(values, mask, "prompt-mean-token-mean", window=groups)
    assert got.item() == pytest.approx((2 + 6) / 2)


def test_prompt_mean_is_seq_mean_with_one_sample_per_prompt():
    features, mask, weight, _ = make_problem(seed=7)
    values = per_token_loss(weight, features)
    singletons = AggregationWindow(**window_of(mask, torch.arange(len(values))))
    got = aggregate(values, mask, "prompt-mean-token-mean", window=singletons)
    torch.testing.assert_close(got, aggregate(values, mask, "seq-mean-token-mean"))


def test_a_group_with_no_trained_token_is_not_counted():
    values = torch.tensor([[4.0, 4.0], [9.0, 9.0]])
    mask = torch.tensor([[1, 1], [0, 0]], dtype=torch.bool)
    window = AggregationWindow(**window_of(mask, torch.tensor([0, 1])))
    assert aggregate(values, mask, "prompt-mean-token-mean", window=window).item() == 4.0


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_empty_mask_gives_zero_without_nan(mode):
    values = torch.full((2, 3), float("nan"), requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    out = aggregate(
        values, mask, mode, window=AggregationWindow(**window_of(mask, torch.arange(2)))
    )
    out.backward()
    assert out.item() == 0.0 and torch.all(values.grad == 0)


def test_unknown_mode_and_missing_counts():
    one = torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(torch.zeros(1, 1), one, "mean")
    with pytest.raises(ValueError, match="group_tokens and num_groups"):
        aggregate(torch.zeros(1, 1), one, "prompt-mean-token-mean")
    with pytest.raises(ValueError, match="group_tokens and num_groups"):
        window = AggregationWindow(group_tokens=torch.ones(1))
        aggregate(torch.zeros(1, 1), one, "prompt-mean-token-mean", window=window)
