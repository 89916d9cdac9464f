"""Global token-mean: microbatch accumulation and data-parallel splits give the full-batch gradient."""

import pytest
import torch

from molt_algos.aggregation import AGGREGATIONS, aggregate


def make_problem(seed=0, rows=8, length=10):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(rows, length, 3, generator=gen)
    mask = torch.rand(rows, length, generator=gen) < 0.5
    mask[0] = False  # an empty row
    weight = torch.randn(3, generator=gen)
    return features, mask, weight


def per_token_loss(weight, features):
    return (features @ weight).sin()


def full_batch_grad(features, mask, weight, mode):
    w = weight.clone().requires_grad_()
    aggregate(per_token_loss(w, features), mask, mode).backward()
    return w.grad


def accumulated_grad(features, mask, weight, mode, dp_size, microbatches):
    """Simulated ranks each accumulate microbatches with the window's global counts; the
    data-parallel reduction then *averages* the ranks' gradients, as FSDP does."""
    num_tokens = mask.sum().item()
    num_sequences = (mask.sum(-1) > 0).sum().item()
    rank_grads = []
    for rank_rows in torch.arange(len(features)).chunk(dp_size):
        w = weight.clone().requires_grad_()
        for rows in rank_rows.chunk(microbatches):
            loss = aggregate(
                per_token_loss(w, features[rows]),
                mask[rows],
                mode,
                num_tokens=num_tokens,
                num_sequences=num_sequences,
                dp_size=dp_size,
            )
            loss.backward()
        rank_grads.append(w.grad)
    return torch.stack(rank_grads).mean(0)


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
@pytest.mark.parametrize("dp_size,microbatches", [(1, 1), (1, 4), (2, 2), (4, 1), (2, 3)])
def test_accumulation_and_dp_split_match_full_batch(mode, dp_size, microbatches):
    features, mask, weight = make_problem(seed=dp_size * 10 + microbatches)
    expected = full_batch_grad(features, mask, weight, mode)
    got = accumulated_grad(features, mask, weight, mode, dp_size, microbatches)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_local_mean_per_microbatch_would_differ():
    # The reason for the global denominator: averaging microbatch means is not the token mean.
    features, mask, weight = make_problem(seed=3)
    values = per_token_loss(weight, features)
    halves = [aggregate(values[r], mask[r]) for r in torch.arange(8).chunk(2)]
    assert not torch.isclose(sum(halves) / 2, aggregate(values, mask))


def test_modes_on_a_known_example():
    values = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert aggregate(values, mask, "token-mean").item() == pytest.approx(2.0)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)
    assert aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx(3.0)


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_empty_mask_gives_zero_without_nan(mode):
    values = torch.full((2, 3), float("nan"), requires_grad=True)
    out = aggregate(values, torch.zeros(2, 3, dtype=torch.bool), mode)
    out.backward()
    assert out.item() == 0.0 and torch.all(values.grad == 0)


def test_unknown_mode():
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), "mean")
