"""One microbatch's whole objective, so the trainer stays blind to algorithms; results are device
scalars: nothing here makes the host wait for the GPU."""

from dataclasses import dataclass, field

import torch
from torch import Tensor

from molt_algos.advantages import AdvantageConfig
from molt_algos.aggregation import AggregationName, AggregationWindow, aggregate
from molt_algos.centering import CENTERING_METRICS, score_centering
from molt_algos.correction import importance_weights
from molt_algos.kl import KLConfig, kl_estimate
from molt_algos.losses import POLICY_LOSSES, LossConfig, PolicyLossName, value_loss
from molt_algos.masked import masked_mean


@dataclass
class AlgoConfig:
    """What is optimised (`--algo.*`): estimator, loss, aggregation, filtering, KL."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    policy_loss: PolicyLossName = "ppo"  # the policy loss (docs/concepts/algorithms.md)
    loss: LossConfig = field(default_factory=LossConfig)
    # How per-token losses become one scalar; None: the policy loss's own (molt_algos'
    # LOSS_AGGREGATION: seq-mean-token-mean for gspo, as its paper, token-mean otherwise).
    aggregation: AggregationName | None = None
    entropy_aggregation: AggregationName | None = None  # entropy bonus; None: --algo.aggregation
    kl_aggregation: AggregationName | None = None  # KL loss term; None: --algo.aggregation
    value_aggregation: AggregationName | None = None  # critic (gae); None: --algo.aggregation
    dynamic_filtering_enable: bool = False  # drop groups whose scores are all equal, backfill
    kl: KLConfig = field(default_factory=KLConfig)
    entropy_coef: float = 0.0  # entropy bonus in the loss
    score_centering: bool = False  # score minus the sampler's top-k expectation (centering.py)

    def aggregation_of(self, loss: str) -> str:  # loss: policy, entropy, kl or value
        own = None if loss == "policy" else getattr(self, f"{loss}_aggregation")
        return own or self.aggregation

    def aggregations(self) -> set[str]:
        return {self.aggregation_of(loss) for loss in ("policy", "entropy", "kl", "value")}


@dataclass
class TokenInputs:
    """[rows, T] each; None where the batch has none (an empty padding microbatch)."""

    mask: Tensor  # bool: trained tokens
    advantages: Tensor | None = None
    old_logprobs: Tensor | None = None  # pi_old; None: this forward's (on-policy, ratio 1)
    # What the tokens were sampled with, when this forward is pi_old: IS weights come from it.
    rollout_logprobs: Tensor | None = None
    weights: Tensor | None = None  # IS-correction weights
    ref_logprobs: Tensor | None = None  # the KL loss term's reference
    returns: Tensor | None = None  # critic targets
    old_values: Tensor | None = None
    sampler_head_logprobs: Tensor | None = None  # [rows, T, K] --algo.score_centering


@dataclass
class Objective:
    loss: Tensor  # to backpropagate
    totals: dict[str, Tensor]  # summed over microbatches and ranks
    per_token: dict[str, Tensor | float]  # token means: weighted by the microbatch's tokens
    old_logprobs: Tensor | None = None  # the pi_old the policy loss used


def _or_zeros(values: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like, dtype=torch.float32) if values is None else values


def policy_objective(
    logprobs: Tensor,
    entropy: Tensor,
    head_logprobs: Tensor | None,
    inputs: TokenInputs,
    algo: AlgoConfig,
    window: AggregationWindow,
    dp_size: int,
    sft: bool = False,
) -> Objective:
    """The IS-weighted policy loss (score-centred given `head_logprobs`, the policy's log-probs
    of the sampler's head), minus the entropy bonus, plus the KL term; `sft`: the NLL instead."""
    mask = inputs.mask
    old = logprobs.detach() if inputs.old_logprobs is None else inputs.old_logprobs
    weights = inputs.weights
    if inputs.rollout_logprobs is not None and not sft:
        # This forward runs the weights the tokens are trained from (one optimizer step per
        # batch): its detached log-probs are pi_old exactly, and the IS weights come from them.
        weights = importance_weights(old, inputs.rollout_logprobs, mask, algo.advantage)
    if sft:
        per_token, metrics = torch.where(mask, -logprobs, torch.zeros_like(logprobs)), {}
    else:
        advantages = _or_zeros(inputs.advantages, logprobs)
        result = POLICY_LOSSES[algo.policy_loss](logprobs, old, advantages, mask, algo.loss)
        per_token, metrics = result.per_token, dict(result.metrics)
    if weights is not None:
        per_token = per_token * weights
    if algo.score_centering and not sft:
        if head_logprobs is None:  # a padding microbatch: every rank reports the same keys
            metrics.update(dict.fromkeys(CENTERING_METRICS, 0.0))
        else:
            per_token, centring = score_centering(
                per_token, logprobs, head_logprobs, inputs.sampler_head_logprobs, mask
            )
            metrics.update(centring)

    def reduce(per_token: Tensor, term: str) -> Tensor:
        return aggregate(per_token, mask, algo.aggregation_of(term), dp_size=dp_size, window=window)

    policy_loss = loss = reduce(per_token, "policy")
    if algo.entropy_coef:
        # Only then: a zero coefficient would still send a (zero) gradient through the
        # entropy's part of every vocabulary slice in the log-prob backward.
        loss = loss - algo.entropy_coef * reduce(entropy, "entropy")
    metrics["loss/entropy"] = masked_mean(entropy.detach(), mask)
    if algo.kl.loss_coef > 0:
        ref = logprobs.detach() if inputs.ref_logprobs is None else inputs.ref_logprobs
        kl = kl_estimate(logprobs, ref, mask, algo.kl.estimator)
        loss = loss + algo.kl.loss_coef * reduce(kl, "kl")
        metrics["loss/ref_kl"] = masked_mean(kl.detach(), mask)
    return Objective(loss, {"loss/policy": policy_loss.detach() / dp_size}, metrics, old)


def value_objective(
    values: Tensor,
    inputs: TokenInputs,
    algo: AlgoConfig,
    value_clip: float | None,
    window: AggregationWindow,
    dp_size: int,
) -> Objective:
    old = values.detach() if inputs.old_values is None else inputs.old_values
    result = value_loss(values, old, _or_zeros(inputs.returns, values), inputs.mask, value_clip)
    mode = algo.aggregation_of("value")
    loss = aggregate(result.per_token, inputs.mask, mode, dp_size=dp_size, window=window)
    return Objective(loss, {"loss/value": loss.detach() / dp_size}, result.metrics)
