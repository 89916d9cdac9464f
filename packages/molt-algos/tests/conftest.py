import random

import pytest
import torch

from molt_algos.advantages import AdvantageBatch


def random_batch(
    seed: int,
    num_groups: int = 3,
    group_size: int = 4,
    max_segments: int = 3,
    length: int = 12,
    reward_levels: int | None = None,
) -> AdvantageBatch:
    """Rollouts with 1..max_segments segments each, masks with interior gaps (tool output),
    some all-masked rows, segment rows shuffled into the batch but kept in order per rollout."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rows = []  # (rollout_id, group_id, reward)
    rollout_id = 100
    for g in range(num_groups):
        for _ in range(group_size):
            reward = rng.randint(0, reward_levels - 1) if reward_levels else rng.gauss(0, 1)
            for _ in range(rng.randint(1, max_segments)):
                rows.append((rollout_id, 10 * g + 7, float(reward)))
            rollout_id += 3
    # Interleave rollouts while keeping each rollout's segments in order.
    queues: dict[int, list] = {}
    for row in rows:
        queues.setdefault(row[0], []).append(row)
    ordered = []
    while queues:
        rid = rng.choice(sorted(queues))
        ordered.append(queues[rid].pop(0))
        if not queues[rid]:
            del queues[rid]
    mask = torch.rand(len(ordered), length, generator=gen) < 0.6
    mask[rng.randrange(len(ordered))] = False  # an all-masked row
    return AdvantageBatch(
        rewards=torch.tensor([r[2] for r in ordered]),
        action_mask=mask,
        group_ids=torch.tensor([r[1] for r in ordered]),
        rollout_ids=torch.tensor([r[0] for r in ordered]),
        kl=torch.rand(len(ordered), length, generator=gen) * 0.1,
        values=torch.randn(len(ordered), length, generator=gen),
        logprobs=-torch.rand(len(ordered), length, generator=gen) * 3,
        teacher_logprobs=-torch.rand(len(ordered), length, generator=gen) * 3,
    )


@pytest.fixture
def batch_factory():
    return random_batch
