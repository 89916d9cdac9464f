"""A batch of prompt groups as training samples, one per rollout segment (advantages, IS)."""

# With one optimizer step over the batch (`reuses_training_forward`) there is no old-policy
# pass: the samples carry the rollout log-probs, the objective takes pi_old from the training
# forward, and `correction_metrics` reports the IS metrics from the log-probs the step used.

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from molt_algos import (
    AdvantageBatch,
    RewardConfig,
    compute_advantages,
    importance_correction,
    kl_estimate,
    shape_rewards,
)
from molt_algos.objective import AlgoConfig
from molt_capture.types import Rollout, Segment
from molt_rollout.agents.pool import Batch
from molt_train.config import RunConfig
from molt_train.metrics import is_truncated
from molt_train.model_group import ModelGroup
from molt_train.packing import Sample, padded_rows
from molt_train.routing_replay import routing_array


@dataclass
class Experience:
    samples: list[Sample]  # one per rollout segment, group by group
    sample_groups: list[str]  # the group id of each sample
    rollouts: list[Rollout]
    metrics: dict[str, float]
    # Without a separate old-policy pass: (rollout log-probs, loss mask, tokens sampled by the
    # trained version) [B, T], for `correction_metrics` after the step
    pending_correction: tuple[Tensor, Tensor, Tensor] | None = None


def reuses_training_forward(cfg: RunConfig) -> bool:
    """Whether the old-policy log-probs come from the training forward (one step, no pass)."""
    # A reference (the KL in the reward, `ref/kl`) reads them, and an IS mode that drops tokens
    # changes the step's token count, which normalises every microbatch's loss.
    adv = cfg.algo.advantage
    per_token_weight = adv.is_correction_level == "off" or (
        adv.is_correction_level == "token" and adv.is_correction_mode in ("clip", "trunc")
    )
    one_step = cfg.train.epochs_per_batch == 1 and cfg.train.mini_batches == 1
    return one_step and not cfg.ref.enable and per_token_weight


def correction_metrics(
    experience: Experience, old_logprobs: list[np.ndarray], algo: AlgoConfig
) -> dict[str, float]:
    """The IS metrics of a step without an old-policy pass, from the log-probs it used."""
    rollout_logprobs, mask, current = experience.pending_correction
    old = padded_rows(old_logprobs, mask.shape[1], torch.float32)
    return importance_correction(old, rollout_logprobs, mask, algo.advantage, current).metrics


def make_experience(
    batch: Batch,
    version: int,
    cfg: RunConfig,
    kl_coef: float,
    policy: ModelGroup,
    reference: ModelGroup | None = None,
    critic: ModelGroup | None = None,
    reuse_training_forward: bool = False,
) -> Experience:
    """Samples with advantages, old log-probs and IS weights, trained at weight `version`."""
    # kl_coef: the KL controller's current coefficient.
    algo, replay = cfg.algo, cfg.train.routing_replay
    rollouts = [r for group in batch.groups for r in group.rollouts]
    segments = [(r, s) for r in rollouts for s in r.segments]
    samples = [_sample(s, algo.score_centering, replay) for _, s in segments]
    width = max(len(s.token_ids) for s in samples)

    def rows(values: list, dtype: torch.dtype = torch.float32) -> Tensor:
        return padded_rows(values, width, dtype)

    mask = rows([s.loss_mask for s in samples], torch.bool)
    rollout_logprobs = rows([s.logprobs for _, s in segments])
    ref = rows(reference.forward_logprobs(samples)) if reference else None
    values = rows(critic.forward_logprobs(samples)) if critic else None
    # `is/vllm_kl` is the engine/trainer mismatch alone: over the tokens sampled by exactly the
    # weights being trained (molt_algos.correction).
    current = rows([s.weight_versions for _, s in segments], torch.long) == version
    metrics: dict[str, float] = {}
    fields: dict[str, Tensor] = {"rollout_logprobs": rollout_logprobs}
    old = kl = None
    if not reuse_training_forward:
        old = rows(policy.forward_logprobs(samples))
        correction = importance_correction(old, rollout_logprobs, mask, algo.advantage, current)
        metrics.update(correction.metrics)
        fields = {"loss_mask": correction.mask, "old_logprobs": old, "weights": correction.weights}
    if ref is not None:
        kl = kl_estimate(old, ref, mask, algo.kl.estimator)
        metrics["ref/kl"] = (kl.sum() / mask.sum().clamp(min=1)).item()
        fields["ref_logprobs"] = ref

    batch_ = _advantage_batch(rollouts, segments, mask, cfg.reward, metrics)
    kl = kl if kl_coef > 0 else None  # KL in the reward
    advantages = compute_advantages(
        dataclasses.replace(batch_, kl=kl, values=values, logprobs=old, teacher_logprobs=ref),
        dataclasses.replace(algo.advantage, kl_coef=kl_coef),  # the controller's coefficient
    )
    metrics.update(advantages.metrics)
    fields["advantages"] = advantages.advantages
    if values is not None:
        fields.update(old_values=values, returns=advantages.returns)
    for name, batch_rows in fields.items():  # each sample's row: a view of the batch's
        for sample, row in zip(samples, batch_rows.numpy(), strict=True):
            setattr(sample, name, row[: len(sample.token_ids)])
    pending = (rollout_logprobs, mask, current) if reuse_training_forward else None
    return Experience(samples, [r.group_id for r, _ in segments], rollouts, metrics, pending)


def _sample(segment: Segment, centering: bool, routing_replay: bool) -> Sample:
    """A segment's tokens, its routed experts and the sampler's candidates where asked."""
    routing = segment.routed_experts  # with --vllm.enable_return_routed_experts
    if routing_replay and routing is None:
        raise ValueError(
            "--train.routing_replay: a rollout segment carries no routed experts (does the "
            "engine run with --vllm.enable_return_routed_experts, and is the model MoE?)"
        )
    if centering and (segment.top_ids is None or segment.top_logprobs is None):
        raise ValueError(
            "--algo.score_centering: a rollout segment carries no top-k candidates (does the "
            "run set --rollout.top_logprobs?)"
        )
    return Sample(
        token_ids=np.asarray(segment.token_ids),
        loss_mask=np.asarray(segment.trainable, dtype=bool),
        temperature=segment.temperature,
        routed_experts=None if routing is None else routing_array(routing),
        head_ids=segment.top_ids if centering else None,
        head_logprobs=segment.top_logprobs if centering else None,
        images=segment.images,
    )


def _advantage_batch(
    rollouts: list[Rollout], segments: list, mask: Tensor, reward: RewardConfig, metrics: dict
) -> AdvantageBatch:
    """Each segment's length-shaped reward, group and rollout (shaping metrics: `metrics`)."""
    # Advantages see every generated token (`mask`): IS filtering is the loss's.
    shaped = shape_rewards(
        torch.tensor([r.reward for r in rollouts], dtype=torch.float32),
        torch.tensor([sum(s.num_generated for s in r.segments) for r in rollouts]),
        torch.tensor([is_truncated(r) for r in rollouts]),
        reward,
    )
    metrics.update(shaped.metrics)
    groups = {g: i for i, g in enumerate(dict.fromkeys(r.group_id for r in rollouts))}
    index = {r.rollout_id: i for i, r in enumerate(rollouts)}
    rollout_ids = torch.tensor([index[r.rollout_id] for r, _ in segments])
    group_ids = torch.tensor([groups[r.group_id] for r, _ in segments])
    return AdvantageBatch(shaped.rewards[rollout_ids], mask, group_ids, rollout_ids)
