"""Per-token KL(pi || pi_ref) estimators k1, k2, k3 (Schulman, "Approximating KL divergence"),
clamped so a -inf reference log-prob gives no inf or NaN; and the reward's KL coefficient."""

from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import Tensor

from molt_algos.masked import safe_log_ratio

KL_LIMIT = 10.0  # |estimate| bound per token


@dataclass
class KLConfig:
    """KL to the reference model (`--algo.kl.*`); needs a reference policy."""

    loss_coef: float = 0.0  # weight of the KL loss term (0: no KL loss)
    estimator: Literal["k1", "k2", "k3"] = "k3"  # per-token estimator of the KL loss term
    target: float | None = None  # adaptive coefficient of the reward KL toward this KL
    horizon: float = 10_000.0  # adaptive KL: samples over which the coefficient adapts


KL_ESTIMATORS = {
    "k1": lambda log_ratio: log_ratio,
    "k2": lambda log_ratio: 0.5 * log_ratio**2,
    "k3": lambda log_ratio: torch.exp(-log_ratio) - 1 + log_ratio,
}


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k3"):
    if estimator not in KL_ESTIMATORS:
        choices = sorted(KL_ESTIMATORS)
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {choices}")
    kl = KL_ESTIMATORS[estimator](safe_log_ratio(logprobs, ref_logprobs, mask))
    return torch.where(mask, kl.clamp(-KL_LIMIT, KL_LIMIT), torch.zeros_like(kl))


@dataclass
class KLController:
    """The reward's KL coefficient: constant without a `target`, else adapted toward it (Ziegler
    et al., 2019): coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * num_samples / horizon."""

    coef: float
    target: float | None = None
    horizon: float = 10_000.0

    def update(self, observed_kl: float, num_samples: int) -> None:
        if self.target is not None:
            error = min(max(observed_kl / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * num_samples / self.horizon

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.coef = state["coef"]
        if self.target is not None:
            self.target, self.horizon = state["target"], state["horizon"]


def kl_controller(coef: float, target: float | None = None, horizon: float = 10_000.0):
    if target is not None and (target <= 0 or horizon <= 0):
        raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}")
    return KLController(coef, target, horizon)
