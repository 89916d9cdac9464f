"""Experience: from a batch of finished prompt groups to per-token training samples.

One sample per rollout segment, exactly the token ids the engine saw and produced. The trainer
recomputes the proximal ("old") log-probs in batched, packed forwards; the train/rollout
mismatch is corrected per token against the log-probs the tokens were sampled with; advantages
come from molt-algos. The actor then only consumes per-token advantages, weights and masks.

When the update is one optimizer step over the batch (`reuses_training_forward`), the old
log-probs are the training forward's own, detached: that forward runs the very weights a
separate pass would, before they change. Then there is no separate pass: the samples carry the
rollout log-probs, the worker derives the IS weights in the loss, and `correction_metrics`
reports the IS metrics from the log-probs the step hands back.
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
from molt_train.config import AlgoConfig, RunConfig
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
    # Without a separate old-policy pass: (rollout log-probs, loss mask, tokens sampled by the
    # trained version) [B, T], for `correction_metrics` after the step
    pending_correction: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def reuses_training_forward(cfg: RunConfig) -> bool:
    """Whether the old-policy log-probs come from the training forward (no separate pass). It
    takes one optimizer step over the batch (one epoch, one mini-batch): the training forward
    then runs exactly the weights a separate pass would. And nothing may need them before that
    forward: a reference (the KL in the reward, `ref/kl`) reads them, and an IS mode that
    drops tokens changes the step's token count, which normalises every microbatch's loss."""
    adv = cfg.algo.advantage
    per_token_weight = adv.is_correction_level == "off" or (
        adv.is_correction_level == "token" and adv.is_correction_mode in ("clip", "trunc")
    )
    one_step = cfg.train.epochs_per_batch == 1 and cfg.train.mini_batches == 1
    return one_step and not cfg.ref.enable and per_token_weight


def correction_metrics(
    experience: Experience, old_logprobs: list[list[float]], algo: AlgoConfig
) -> dict[str, float]:
    """The IS metrics of a step trained without a separate old-policy pass, from the old
    log-probs the step used (ModelGroup.train_step's): the same function over the same
    tensors as `make_experience` with the pass."""
    rollout_logprobs, mask, current = experience.pending_correction
    old = _padded(old_logprobs, mask.shape[1])
    return importance_correction(old, rollout_logprobs, mask, algo.advantage, current).metrics


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
    reuse_training_forward: bool = False,
) -> Experience:
    """Samples with advantages, old log-probs and IS weights for one training batch, trained
    at weight `version`. `kl_coef`: the current coefficient of KL in the reward.
    `routing_replay`: the policy's forwards replay each segment's recorded MoE routing.
    `reward`: length shaping of the rollouts' rewards before advantages (budget resolved).
    `reuse_training_forward` (`reuses_training_forward`, no reference): no old-policy pass;
    samples carry the rollout log-probs instead of old log-probs and IS weights."""
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
            images=s.images,
        )
        for _, s in segments
    ]
    lengths = [len(s.token_ids) for s in samples]
    width = max(lengths)
    mask = _padded([s.trainable for _, s in segments], width).bool()
    rollout_logprobs = _padded([s.logprobs for _, s in segments], width)

    ref = _padded(reference.forward_logprobs(samples), width) if reference else None
    values = _padded(critic.forward_values(samples), width) if critic else None

    # `is/vllm_kl` is the engine/trainer mismatch alone: over the tokens sampled by exactly the
    # weights being trained (molt_algos.correction).
    current = _padded([s.weight_versions for _, s in segments], width) == version
    metrics: dict[str, float] = {}
    old = correction = None
    if not reuse_training_forward:
        old = _padded(policy.forward_logprobs(samples), width)
        correction = importance_correction(old, rollout_logprobs, mask, algo.advantage, current)
        metrics.update(correction.metrics)
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
        sample.advantages = advantages.advantages[i, :n].tolist()
        if correction is None:
            sample.rollout_logprobs = rollout_logprobs[i, :n].tolist()
        else:
            sample.loss_mask = correction.mask[i, :n].int().tolist()
            sample.old_logprobs = old[i, :n].tolist()
            sample.weights = correction.weights[i, :n].tolist()
        if ref is not None:
            sample.ref_logprobs = ref[i, :n].tolist()
        if values is not None:
            sample.old_values = values[i, :n].tolist()
            sample.returns = advantages.returns[i, :n].tolist()
    pending = (rollout_logprobs, mask, current) if correction is None else None
    return Experience(samples, [r.group_id for r, _ in segments], rollouts, metrics, pending)
