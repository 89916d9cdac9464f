"""molt-algos: RL estimators, losses and corrections as pure functions over torch tensors.

Selected by name through plain dicts: `ADVANTAGE_ESTIMATORS`, `POLICY_LOSSES`, `AGGREGATIONS`,
`KL_ESTIMATORS`; length shaping of rewards is `shape_rewards`. Formulas, flag values and metric names: docs/algorithms.md.
"""

from molt_algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    GROUP_ESTIMATORS,
    KL_IN_REWARD_ESTIMATORS,
    AdvantageBatch,
    AdvantageConfig,
    Advantages,
    EstimatorName,
    compute_advantages,
    validate_advantage_config,
)
from molt_algos.aggregation import (
    AGGREGATIONS,
    GROUP_AGGREGATIONS,
    AggregationName,
    AggregationWindow,
    aggregate,
)
from molt_algos.centering import CENTERING_METRICS, score_centering
from molt_algos.correction import (
    IS_GATINGS,
    IS_LEVELS,
    IS_MODES,
    Correction,
    importance_correction,
    importance_weights,
    sampled_token_divergence,
    validate_is_correction,
)
from molt_algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLConfig,
    kl_controller,
    kl_estimate,
)
from molt_algos.logprobs import logprobs_from_logits, token_logprobs_and_entropy
from molt_algos.losses import (
    LOSS_AGGREGATION,
    POLICY_LOSSES,
    LossConfig,
    PolicyLoss,
    PolicyLossName,
    validate_loss_config,
    value_loss,
)
from molt_algos.masked import safe_log_ratio
from molt_algos.shaping import (
    RewardConfig,
    ShapedRewards,
    shape_rewards,
    shaping_enabled,
    validate_reward_config,
)

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CENTERING_METRICS",
    "AGGREGATIONS",
    "GROUP_AGGREGATIONS",
    "GROUP_ESTIMATORS",
    "IS_GATINGS",
    "IS_LEVELS",
    "IS_MODES",
    "KL_ESTIMATORS",
    "KL_IN_REWARD_ESTIMATORS",
    "LOSS_AGGREGATION",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageBatch",
    "AdvantageConfig",
    "Advantages",
    "Correction",
    "FixedKLController",
    "AggregationName",
    "AggregationWindow",
    "EstimatorName",
    "KLConfig",
    "PolicyLossName",
    "LossConfig",
    "PolicyLoss",
    "RewardConfig",
    "ShapedRewards",
    "aggregate",
    "compute_advantages",
    "importance_correction",
    "importance_weights",
    "kl_controller",
    "kl_estimate",
    "logprobs_from_logits",
    "safe_log_ratio",
    "sampled_token_divergence",
    "score_centering",
    "shape_rewards",
    "shaping_enabled",
    "token_logprobs_and_entropy",
    "validate_advantage_config",
    "validate_is_correction",
    "validate_loss_config",
    "validate_reward_config",
    "value_loss",
]
