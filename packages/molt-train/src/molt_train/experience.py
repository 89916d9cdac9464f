"""Experience: from a batch of finished prompt groups to per-token training samples.

One sample per rollout segment, exactly the token ids the engine saw and produced. The trainer
recomputes the proximal ("old") log-probs in batched, packed forwards; the train/rollout
mismatch is corrected per token against the log-probs the tokens were sampled with; advantages
come from molt-algos. The actor then only consumes per-token advantages, weights and masks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from molt_algos import (
    AdvantageBatch,
    RewardConfig,
    compute_advantages,
    importance_correction,
    kl_estimate,
    shape_rewards,
)
from molt_capture.types import Rollout, Segment
from molt_rollout.pool import Batch
from molt_train.config import AlgoConfig
from molt_train.metrics import is_truncated
from molt_train.model_group import ModelGroup
from molt_train.packing import Sample
from molt_train.routing_replay import routing_array


@dataclass
class Experience:
    samples: list[Sample]  # one per rollout segment, group by group
    sample_groups: list[str]  # the group id of each sample
    rollouts: list[Rollout]
    metrics: dict[str, float]


def _padded(rows: list[list[float]], length: int, dtype=torch.float32) -> torch.Tensor:
    out = torch.zeros(len(rows), length, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def _routing(segment: Segment) -> np.ndarray:
    if segment.routed_experts is None:
        raise ValueError(
            "--train.routing_replay: a rollout segment carries no routed experts (does the "
            "engine run with --vllm.enable_return_routed_experts, and is the model MoE?)"
        )
    return routing_array(segment.routed_experts)


def _heads(segment: Segment) -> tuple[list[list[int]], list[list[float]]]:
    if segment.top_ids is None or segment.top_logprobs is None:
        raise ValueError(
            "--algo.score_centering: a rollout segment carries no top-k candidates (does the "
            "run set --rollout.top_logprobs?)"
        )
    return segment.top_ids, segment.top_logprobs


def make_experience(
    batch: Batch,
    version: int,
    policy: ModelGroup,
    algo: AlgoConfig,
    kl_coef: float,
    reference: ModelGroup | None = None,
    critic: ModelGroup | None = None,
    routing_replay: bool = False,
    reward: RewardConfig | None = None,
) -> Experience:
    """Samples with advantages, old log-probs and IS weights for one training batch, trained
    at weight `version`. `kl_coef`: the current coefficient of KL in the reward.
    `routing_replay`: the policy's forwards replay each segment's recorded MoE routing.
    `reward`: length shaping of the rollouts' rewards before advantages (budget resolved)."""
    rollouts = [r for group in batch.groups for r in group.rollouts]
    segments = [(r, s) for r in rollouts for s in r.segments]
    samples = [
        Sample(
            token_ids=s.token_ids,
            loss_mask=s.trainable,
            temperature=s.temperature,
            routed_experts=_routing(s) if routing_replay else None,
            head_ids=_heads(s)[0] if algo.score_centering else None,
            head_logprobs=_heads(s)[1] if algo.score_centering else None,
        )
        for _, s in segments
    ]
    lengths = [len(s.token_ids) for s in samples]
    width = max(lengths)
    mask = _padded([s.trainable for _, s in segments], width).bool()
    rollout_logprobs = _padded([s.logprobs for _, s in segments], width)

    old = _padded(policy.forward_logprobs(samples), width)
    ref = _padded(reference.forward_logprobs(samples), width) if reference else None
    values = _padded(critic.forward_values(samples), width) if critic else None

    # `is/vllm_kl` is the engine/trainer mismatch alone: over the tokens sampled by exactly the
    # weights being trained (molt_algos.correction).
    current = _padded([s.weight_versions for _, s in segments], width) == version
    correction = importance_correction(old, rollout_logprobs, mask, algo.advantage, current)
    metrics = dict(correction.metrics)
    kl = None
    if ref is not None:
        kl = kl_estimate(old, ref, mask, algo.kl.estimator)
        metrics["ref/kl"] = (kl.sum() / mask.sum().clamp(min=1)).item()

    shaped = shape_rewards(
        torch.tensor([r.reward for r in rollouts], dtype=torch.float32),
        torch.tensor([sum(s.num_generated for s in r.segments) for r in rollouts]),
        torch.tensor([is_truncated(r) for r in rollouts]),
        reward or RewardConfig(),
    )
    metrics.update(shaped.metrics)
    group_index = {g: i for i, g in enumerate(dict.fromkeys(r.group_id for r in rollouts))}
    rollout_index = {r.rollout_id: i for i, r in enumerate(rollouts)}
    segment_rewards = [shaped.rewards[rollout_index[r.rollout_id]] for r, _ in segments]
    advantages = compute_advantages(
        AdvantageBatch(
            rewards=torch.stack(segment_rewards),
            action_mask=mask,  # advantages see every generated token; IS filtering is the loss's
            group_ids=torch.tensor([group_index[r.group_id] for r, _ in segments]),
            rollout_ids=torch.tensor([rollout_index[r.rollout_id] for r, _ in segments]),
            kl=kl if kl_coef > 0 else None,
            values=values,
            logprobs=old,
            teacher_logprobs=ref,
        ),
        dataclasses.replace(algo.advantage, kl_coef=kl_coef),  # the controller's coefficient
    )
    metrics.update(advantages.metrics)

    for i, sample in enumerate(samples):
        n = lengths[i]
        sample.loss_mask = correction.mask[i, :n].int().tolist()
        sample.advantages = advantages.advantages[i, :n].tolist()
        sample.old_logprobs = old[i, :n].tolist()
        sample.weights = correction.weights[i, :n].tolist()
        if ref is not None:
            sample.ref_logprobs = ref[i, :n].tolist()
        if values is not None:
            sample.old_values = values[i, :n].tolist()
            sample.returns = advantages.returns[i, :n].tolist()
    return Experience(samples, [r.group_id for r, _ in segments], rollouts, metrics)
