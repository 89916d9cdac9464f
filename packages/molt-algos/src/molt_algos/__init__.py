"""molt-algos: RL estimators, losses and corrections as pure functions over torch tensors, and
`policy_objective` / `value_objective`, one microbatch's whole loss. docs/concepts/algorithms.md."""

# ruff: noqa: F401  (the names below are the package's public API, imported from here)
from molt_algos.advantages import (
    AdvantageBatch,
    AdvantageConfig,
    compute_advantages,
    estimator_needs,
    validate_advantage_config,
)
from molt_algos.aggregation import GROUP_AGGREGATIONS, AggregationWindow, aggregate
from molt_algos.correction import importance_correction, validate_is_correction
from molt_algos.kl import KLConfig, kl_controller, kl_estimate
from molt_algos.logprobs import logprobs_from_logits, token_logprobs_and_entropy
from molt_algos.losses import LOSS_AGGREGATION, POLICY_LOSSES, LossConfig, validate_loss_config
from molt_algos.objective import (
    AlgoConfig,
    Objective,
    TokenInputs,
    policy_objective,
    value_objective,
)
from molt_algos.shaping import RewardConfig, shape_rewards, validate_reward_config
