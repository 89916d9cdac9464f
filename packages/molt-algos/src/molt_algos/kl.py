"""KL estimators between the policy and a reference, and the KL coefficient controllers.

With samples y ~ pi and log_ratio = log pi(y) - log pi_ref(y), the estimators of
KL(pi || pi_ref) per token are (Schulman, "Approximating KL divergence"):
  k1 = log_ratio                          unbiased, high variance, can be negative
  k2 = 0.5 * log_ratio^2                  biased, low variance, >= 0
  k3 = exp(-log_ratio) - 1 + log_ratio    unbiased, low variance, >= 0
The log-ratio is sanitised and clamped before use and the result clamped, so a token whose
reference log-prob is -inf cannot produce inf or NaN.

Used as a reward term (advantage estimators' `kl_coef`) or as a loss aggregated like any other
per-token loss (molt_algos.aggregation).
"""

from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import Tensor

from molt_algos.masked import safe_log_ratio


@dataclass
class KLConfig:
    """KL to the reference model (`--algo.kl.*`); needs a reference policy."""

    loss_coef: float = 0.0  # weight of the KL loss term (0: no KL loss)
    estimator: Literal["k1", "k2", "k3"] = "k3"  # per-token estimator of the KL loss term
    target: float | None = None  # adaptive coefficient of the reward KL toward this KL
    horizon: float = 10_000.0  # adaptive KL: samples over which the coefficient adapts


def kl_estimate(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    estimator: str = "k3",
    kl_limit: float = 10.0,
) -> Tensor:
    """Per-token KL estimate [B, T]; 0 outside `mask`. `estimator` is k1, k2 or k3."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; choose one of {sorted(KL_ESTIMATORS)}"
        )
    kl = KL_ESTIMATORS[estimator](safe_log_ratio(logprobs, ref_logprobs, mask))
    return torch.where(mask, kl.clamp(-kl_limit, kl_limit), torch.zeros_like(kl))


KL_ESTIMATORS = {
    "k1": lambda log_ratio: log_ratio,
    "k2": lambda log_ratio: 0.5 * log_ratio**2,
    "k3": lambda log_ratio: torch.exp(-log_ratio) - 1 + log_ratio,
}


@dataclass
class FixedKLController:
    """A constant coefficient."""

    coef: float

    def update(self, observed_kl: float, num_samples: int) -> None:
        pass

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.coef = state["coef"]


@dataclass
class AdaptiveKLController:
    """Proportional control of the coefficient toward a target KL (Ziegler et al., 2019):
    e = clip(KL / target - 1, -0.2, 0.2); coef <- coef * (1 + e * num_samples / horizon)."""

    coef: float
    target: float
    horizon: float = 10_000.0

    def update(self, observed_kl: float, num_samples: int) -> None:
        error = min(max(observed_kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * num_samples / self.horizon

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.target, self.horizon = state["coef"], state["target"], state["horizon"]


def kl_controller(coef: float, target: float | None = None, horizon: float = 10_000.0):
    """Fixed when `target` is None, adaptive otherwise."""
    if target is None:
        return FixedKLController(coef)
    if target <= 0 or horizon <= 0:
        raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}")
    return AdaptiveKLController(coef, target, horizon)
