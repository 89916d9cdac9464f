"""make_experience without Ray: a stand-in policy returns the sampled log-probs, so the test
follows rewards through length shaping into advantages."""

import pytest

from molt_algos import AlgoConfig, RewardConfig
from molt_capture.types import Generation, Rollout, Segment
from molt_rollout.agents.pool import Batch, GroupResult
from molt_train.config import RunConfig
from molt_train.experience import make_experience


class SampledLogprobs:
    """forward_logprobs as if trainer and engine agreed exactly (IS ratio 1)."""

    def __init__(self, segments):
        self.by_ids = {tuple(s.token_ids): s.logprobs for s in segments}

    def forward_logprobs(self, samples):
        return [list(self.by_ids[tuple(s.token_ids)]) for s in samples]


def rollout(index: int, reward: float, generated: int, finish: str, k: int = 0) -> Rollout:
    seg = Segment()
    seg.append_context([1, 2, 100 + index])
    heads = {}
    if k:
        heads = dict(top_ids=[[7 + index, 3][:k]] * generated,
                     top_logprobs=[[-0.5, -1.5][:k]] * generated)  # fmt: skip
    gen = Generation([7 + index] * generated, [-0.5] * generated, finish, [0] * generated, **heads)
    seg.append_generation(gen, max_tokens=4)
    return Rollout([seg], reward, rollout_id=f"r{index}", group_id=f"g{index}")


def batch_of(rollouts):
    groups = [GroupResult(task=None, rollouts=[r]) for r in rollouts]
    return Batch(groups=groups, metrics={}, dropped={})


def test_length_shaping_reaches_the_advantages():
    rollouts = [
        rollout(0, 1.0, 1, "stop"),
        rollout(1, 1.0, 4, "length"),
        rollout(2, 0.0, 2, "stop"),
    ]
    policy = SampledLogprobs([s for r in rollouts for s in r.segments])
    algo = AlgoConfig()
    algo.advantage.estimator = "flash_reinforce"
    shaping = RewardConfig(
        overlong_buffer_len=2, max_response_len=4, stop_properly_penalty_coef=0.5
    )
    exp = make_experience(batch_of(rollouts), 0, RunConfig(algo=algo, reward=shaping), 0.0, policy)
    # Shaped: 1.0; 1.0 * 0.5 (truncated) - 1.0 (at the budget); 0.0 (2 <= 4 - 2 tokens).
    shaped = [1.0, -0.5, 0.0]
    baseline = sum(shaped) / 3
    for sample, reward in zip(exp.samples, shaped, strict=True):
        trained = [a for a, m in zip(sample.advantages, sample.loss_mask, strict=True) if m]
        assert trained == pytest.approx([reward - baseline] * len(trained))
    assert exp.metrics["reward/raw_mean"] == pytest.approx(2 / 3)
    assert exp.metrics["reward/shaped_mean"] == pytest.approx(baseline)
    assert exp.metrics["reward/truncated_frac"] == pytest.approx(1 / 3)
    assert exp.metrics["reward/overlong_frac"] == pytest.approx(1 / 3)
    assert exp.rollouts[1].reward == 1.0  # the task reward is kept for rollout/* metrics


def test_no_shaping_by_default():
    rollouts = [rollout(0, 1.0, 3, "length"), rollout(1, 0.0, 3, "stop")]
    policy = SampledLogprobs([s for r in rollouts for s in r.segments])
    algo = AlgoConfig()
    algo.advantage.estimator = "flash_reinforce"
    exp = make_experience(batch_of(rollouts), 0, RunConfig(algo=algo), 0.0, policy)
    assert not any(key.startswith("reward/") for key in exp.metrics)
    assert max(exp.samples[0].advantages) == pytest.approx(0.5)


def test_score_centering_carries_the_sampler_heads():
    rollouts = [rollout(0, 1.0, 2, "stop", k=2), rollout(1, 0.0, 1, "stop", k=2)]
    policy = SampledLogprobs([s for r in rollouts for s in r.segments])
    algo = AlgoConfig(score_centering=True)
    algo.advantage.estimator = "flash_reinforce"
    exp = make_experience(batch_of(rollouts), 0, RunConfig(algo=algo), 0.0, policy)
    assert exp.samples[0].head_ids == [[], [], [], [7, 3], [7, 3]]
    assert exp.samples[1].head_logprobs == [[], [], [], [-0.5, -1.5]]
    plain = [rollout(0, 1.0, 2, "stop")]
    with pytest.raises(ValueError, match="top_logprobs"):
        make_experience(
            batch_of(plain), 0, RunConfig(algo=algo), 0.0, SampledLogprobs(plain[0].segments)
        )
