"""The counts the driver hands the workers make prompt-mean-token-mean a global mean: the
planned microbatches of every rank, reduced with them, sum to the full-window loss."""

import random

import pytest
import torch

from molt_algos import AggregationWindow, aggregate
from molt_train.model_group import group_token_counts
from molt_train.packing import Sample, plan_microbatches


def window_samples(seed: int) -> tuple[list[Sample], list[str]]:
    rng = random.Random(seed)
    samples, groups = [], []
    for g in range(5):
        for _ in range(rng.randint(1, 4)):  # groups of unequal size and length
            prompt, response = rng.randint(1, 4), rng.randint(0 if g == 4 else 1, 9)
            mask = [0] * prompt + [rng.random() < 0.8 for _ in range(response)]
            samples.append(Sample(token_ids=[1] * len(mask), loss_mask=[int(m) for m in mask]))
            groups.append(f"group-{g}")
    order = list(range(len(samples)))
    rng.shuffle(order)  # a group's samples spread over microbatches and ranks
    return [samples[i] for i in order], [groups[i] for i in order]


def loss_of(sample: Sample, index: int) -> list[float]:
    return [((index + 1) * (t + 2)) % 7 / 3.0 for t in range(len(sample.token_ids))]


def group_means(samples: list[Sample], groups: list[str]) -> float:
    """Reference: each group's token mean, averaged over the groups with a trained token."""
    sums: dict[str, list[float]] = {}
    for i, (sample, group) in enumerate(zip(samples, groups, strict=True)):
        values = [v for v, m in zip(loss_of(sample, i), sample.loss_mask, strict=True) if m]
        sums.setdefault(group, []).extend(values)
    means = [sum(v) / len(v) for v in sums.values() if v]
    return sum(means) / len(means)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dp_size,budget", [(1, 12), (2, 16), (3, 30)])
def test_planned_microbatches_sum_to_the_prompt_mean(seed, dp_size, budget):
    samples, groups = window_samples(seed)
    num_groups, tokens = group_token_counts(samples, groups)
    assert num_groups == len({g for s, g in zip(samples, groups, strict=True) if s.num_trained})
    plan = plan_microbatches(samples, budget, dp_size)
    total = 0.0
    for rank_plan in plan:
        for mb in rank_plan:
            if not mb:
                continue
            width = max(len(samples[i].token_ids) for i in mb)
            values = torch.zeros(len(mb), width)
            mask = torch.zeros(len(mb), width, dtype=torch.bool)
            for row, i in enumerate(mb):
                n = len(samples[i].token_ids)
                values[row, :n] = torch.tensor(loss_of(samples[i], i))
                mask[row, :n] = torch.tensor(samples[i].loss_mask, dtype=torch.bool)
            window = AggregationWindow(
                num_groups=num_groups, group_tokens=torch.tensor([tokens[i] for i in mb])
            )
            # dp_size multiplies, FSDP's gradient reduction averages over ranks: both cancel.
            loss = aggregate(values, mask, "prompt-mean-token-mean", dp_size=dp_size, window=window)
            total += loss.item() / dp_size
    assert total == pytest.approx(group_means(samples, groups))


def test_without_groups_every_sample_is_its_own_prompt():
    samples = [Sample([1, 2, 3], [0, 1, 1]), Sample([1, 2], [0, 0]), Sample([4, 5], [0, 1])]
    assert group_token_counts(samples, None) == (2, [2, 0, 1])
    assert group_token_counts(samples, ["a", "b", "a"]) == (1, [3, 0, 3])
