"""Advantage estimators by name (`ADVANTAGE_ESTIMATORS`). A row is one segment of a rollout: group
estimators count each rollout once; token-level ones run over its action tokens across segments."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from molt_algos.masked import masked_mean, masked_min_max, masked_std, to_floats, whiten


@dataclass
class AdvantageBatch:
    rewards: Tensor  # [B] float: the rollout's scalar reward, repeated on each of its segments
    action_mask: Tensor  # [B, T] bool: trainable (generated) tokens
    group_ids: Tensor  # [B] int: prompt group (the n samples of one prompt)
    rollout_ids: Tensor  # [B] int: rollout; its segments are the rows sharing it, in row order
    kl: Tensor | None = None  # [B, T] per-token KL(policy || reference) estimate, for KL in reward
    values: Tensor | None = None  # [B, T] critic values V(s_t) (gae)
    logprobs: Tensor | None = None  # [B, T] student log-probs of the sampled tokens (distill)
    teacher_logprobs: Tensor | None = None  # [B, T] teacher log-probs of the same tokens (distill)


EstimatorName = Literal[
    "reinforce",
    "reinforce_baseline",
    "rloo",
    "grpo",
    "dr_grpo",
    "flash_reinforce",
    "gae",
    "on_policy_distill",
]  # the keys of ADVANTAGE_ESTIMATORS, for typed configs


@dataclass
class AdvantageConfig:
    """The estimator and the train/rollout IS correction (`--algo.advantage.*`)."""

    estimator: EstimatorName = "grpo"  # the advantage estimator (docs/concepts/algorithms.md)
    gamma: float = 1.0  # discount per action token (reinforce, reinforce_baseline, gae)
    lam: float = 1.0  # GAE lambda
    whiten: bool = True  # batch-whiten advantages over action tokens (reinforce*, gae)
    eps: float = 1e-6  # added to standard deviations (grpo, whitening)
    kl_coef: float = 0.0  # KL to the reference in the reward (reinforce*, gae only)
    distill_coef: float = 1.0  # on_policy_distill: weight of the teacher log-ratio
    is_correction_level: Literal["off", "token", "seq", "geo"] = "token"  # what is compared
    is_correction_mode: Literal["mask", "clip", "trunc"] = "trunc"  # outside the band
    is_correction_threshold: float = 2.0  # ratio: the band [1/t, t]; binary_kl, tv: row mean <= t
    # What a sequence gate (level seq/geo) compares with the threshold: the ratio, or the
    # row's mean binary KL or total variation of the sampled tokens (level seq only).
    is_correction_gating: Literal["ratio", "binary_kl", "tv"] = "ratio"  # the gate's statistic


@dataclass
class Advantages:
    advantages: Tensor  # [B, T], 0 outside action_mask
    returns: Tensor | None  # [B, T] discounted returns (reinforce*) or value targets (gae)
    metrics: dict[str, float]


@dataclass(frozen=True)
class Needs:
    critic: bool = False  # a value model, trained beside the policy
    reference: bool = False  # the reference model on every batch (distillation's teacher)
    groups: bool = False  # complete prompt groups of >= 2 samples: a baseline from the others
    kl_reward: bool = False  # takes KL to the reference into a per-token reward (kl_coef)


class Estimator(NamedTuple):
    fn: Callable[[AdvantageBatch, AdvantageConfig], Advantages]
    needs: Needs


def estimator_needs(name: str) -> Needs:
    if name not in ADVANTAGE_ESTIMATORS:
        choices = sorted(ADVANTAGE_ESTIMATORS)
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {choices}")
    return ADVANTAGE_ESTIMATORS[name].needs


def validate_advantage_config(cfg: AdvantageConfig) -> None:
    needs = estimator_needs(cfg.estimator)
    if cfg.kl_coef != 0.0 and not needs.kl_reward:
        kl_reward = sorted(n for n, e in ADVANTAGE_ESTIMATORS.items() if e.needs.kl_reward)
        why = f"puts KL into the reward, which {cfg.estimator} cannot: use a KL loss or {kl_reward}"
        raise ValueError(f"kl_coef={cfg.kl_coef} {why}")
    if not 0.0 <= cfg.gamma <= 1.0 or not 0.0 <= cfg.lam <= 1.0:
        raise ValueError(f"gamma={cfg.gamma} and lam={cfg.lam} must lie in [0, 1]")
    if cfg.eps <= 0.0:
        raise ValueError(f"eps={cfg.eps} must be positive")


def compute_advantages(batch: AdvantageBatch, cfg: AdvantageConfig) -> Advantages:
    validate_advantage_config(cfg)
    return ADVANTAGE_ESTIMATORS[cfg.estimator].fn(batch, cfg)


# --- rollouts and groups ----------------------------------------------------------------------


@dataclass
class _Rollouts:
    of_row: Tensor  # [B] rollout index of each row
    rewards: Tensor  # [R]
    groups: Tensor  # [R] group index (0..G-1)

    @classmethod
    def from_batch(cls, batch: AdvantageBatch) -> "_Rollouts":
        ids, of_row = torch.unique(batch.rollout_ids, return_inverse=True)
        row_rewards = batch.rewards.float()
        rewards = row_rewards.new_zeros(ids.numel()).scatter_(0, of_row, row_rewards)
        if not torch.equal(rewards[of_row], row_rewards):
            raise ValueError("segments of one rollout (same rollout_id) carry different rewards")
        group_of = batch.group_ids.new_zeros(ids.numel()).scatter_(0, of_row, batch.group_ids)
        return cls(of_row, rewards, torch.unique(group_of, return_inverse=True)[1])

    def group_mean_std(self) -> tuple[Tensor, Tensor, Tensor]:
        """Per rollout, float64: its group's mean reward, unbiased std and size. Equal rewards get
        their reward as the mean exactly (a float mean could round off it, eps magnify that)."""
        rewards, groups = self.rewards.double(), self.groups
        num_groups = int(groups.max()) + 1 if groups.numel() else 0
        zeros = torch.zeros(num_groups, dtype=torch.float64, device=rewards.device)
        count = zeros.index_add(0, groups, torch.ones_like(rewards))
        mean = (zeros.index_add(0, groups, rewards) / count)[groups]
        low = zeros.scatter_reduce(0, groups, rewards, "amin", include_self=False)
        high = zeros.scatter_reduce(0, groups, rewards, "amax", include_self=False)
        mean = torch.where((low == high)[groups], rewards, mean)
        var = zeros.index_add(0, groups, (rewards - mean) ** 2) / (count - 1).clamp(min=1)
        return mean, var.sqrt()[groups], count[groups]


@dataclass
class _ActionLayout:
    """Action tokens regrouped per rollout: row r of an [R, L] tensor holds rollout r's action
    tokens, all its segments concatenated in order, right-padded with zeros."""

    action_mask: Tensor  # [B, T]
    rollout_of_token: Tensor  # [N] rollout of each action token, in row-major order
    position: Tensor  # [N] its position among its rollout's action tokens
    lengths: Tensor  # [R] action tokens per rollout

    @classmethod
    def build(cls, action_mask: Tensor, rollouts: _Rollouts) -> "_ActionLayout":
        rollout_of_token = rollouts.of_row[:, None].expand_as(action_mask)[action_mask]
        lengths = torch.bincount(rollout_of_token, minlength=rollouts.rewards.numel())
        # A stable sort keeps row-major (segment, then token) order within each rollout.
        order = torch.sort(rollout_of_token, stable=True).indices
        starts = torch.cumsum(lengths, 0) - lengths
        position = torch.empty_like(order)
        rank = torch.arange(order.numel(), device=order.device)
        position[order] = rank - starts[rollout_of_token[order]]
        return cls(action_mask, rollout_of_token, position, lengths)

    def pack(self, tokens: Tensor) -> Tensor:
        """[N] values of the action tokens (row-major) -> [R, L]."""
        width = int(self.lengths.max()) if self.lengths.numel() else 0
        packed = tokens.new_zeros(self.lengths.numel(), width)
        packed[self.rollout_of_token, self.position] = tokens
        return packed

    def discounted(self, packed: Tensor, discount: float) -> Tensor:
        """y_t = x_t + discount * y_{t+1} over each rollout's action tokens, in place; as [B, T]."""
        running = packed.new_zeros(packed.shape[0])
        for t in range(packed.shape[1] - 1, -1, -1):
            running = packed[:, t] = packed[:, t] + discount * running
        out = packed.new_zeros(self.action_mask.shape)
        out[self.action_mask] = packed[self.rollout_of_token, self.position]
        return out

    def token_rewards(self, batch: AdvantageBatch, cfg: AdvantageConfig, scalar: Tensor) -> Tensor:
        """[R, L]: -kl_coef * kl_t on every action token, plus the rollout's scalar reward on
        its last one."""
        last = self.position == self.lengths[self.rollout_of_token] - 1
        rewards = torch.where(last, scalar[self.rollout_of_token], 0.0)
        if cfg.kl_coef != 0.0:
            if batch.kl is None:
                raise ValueError(f"kl_coef={cfg.kl_coef} but the batch carries no per-token kl")
            rewards = rewards - cfg.kl_coef * batch.kl.float()[self.action_mask]
        return self.pack(rewards)


def _result(advantages: Tensor, mask: Tensor, returns: Tensor | None = None, **extra) -> Advantages:
    low, high = masked_min_max(advantages, mask)
    mean, std = masked_mean(advantages, mask), masked_std(advantages, mask)
    stats = {"mean": mean, "std": std, "min": low, "max": high, **extra}
    metrics = to_floats({f"advantage/{name}": value for name, value in stats.items()})
    return Advantages(advantages, returns, metrics)


# --- group estimators: one scalar per rollout ---------------------------------------------------


def _broadcast(batch: AdvantageBatch, rollouts: _Rollouts, per_rollout: Tensor, **extra):
    mask = batch.action_mask
    per_row = per_rollout.float()[rollouts.of_row][:, None].expand_as(mask)
    return _result(torch.where(mask, per_row, torch.zeros_like(per_row)), mask, **extra)


def group_relative(batch: AdvantageBatch, cfg: AdvantageConfig) -> Advantages:
    """From R_i - mean_g R (a singleton gets 0): GRPO divides it by std_g R + eps (std unbiased),
    RLOO scales it by n / (n - 1), giving R_i - mean_{j != i} R_j, and Dr. GRPO takes it as it
    is (no std division: no difficulty bias; no whitening)."""
    rollouts = _Rollouts.from_batch(batch)
    mean, std, count = rollouts.group_mean_std()
    centred = rollouts.rewards - mean
    if cfg.estimator == "grpo":
        centred = centred / (std + cfg.eps)
    elif cfg.estimator == "rloo":
        centred = torch.where(count > 1, count / (count - 1).clamp(min=1), 0.0) * centred
    return _broadcast(batch, rollouts, centred)


def flash_reinforce(batch: AdvantageBatch, cfg: AdvantageConfig) -> Advantages:
    """FlashREINFORCE: A_i = R_i - mean_batch R over the batch's rollouts (each once). Made for
    one rollout per prompt: no group, no std division, no whitening."""
    rollouts = _Rollouts.from_batch(batch)
    rewards = rollouts.rewards
    baseline = rewards.mean() if rewards.numel() else rewards.sum()
    return _broadcast(batch, rollouts, rewards - baseline, baseline=baseline)


# --- token-level estimators: returns over a rollout's action tokens ---------------------------


def reinforce(batch: AdvantageBatch, cfg: AdvantageConfig) -> Advantages:
    """REINFORCE++: r_t = -kl_coef * kl_t, plus R (reinforce_baseline: R - mean_g R) on the last
    action token; G_t = r_t + gamma * G_{t+1}; A = G, whitened over the batch (`whiten`)."""
    rollouts = _Rollouts.from_batch(batch)
    scalar = rollouts.rewards
    if cfg.estimator == "reinforce_baseline":
        scalar = (scalar.double() - rollouts.group_mean_std()[0]).float()
    layout = _ActionLayout.build(batch.action_mask, rollouts)
    returns = layout.discounted(layout.token_rewards(batch, cfg, scalar), cfg.gamma)
    mask = batch.action_mask
    advantages = whiten(returns, mask, cfg.eps) if cfg.whiten else returns
    return _result(advantages, mask, returns, return_mean=masked_mean(returns, mask))


def gae(batch: AdvantageBatch, cfg: AdvantageConfig) -> Advantages:
    """GAE: delta_t = r_t + gamma * V_{t+1} - V_t (V = 0 past the end, r_t as in `reinforce`),
    A_t = delta_t + gamma * lam * A_{t+1}; value targets A + V, before whitening."""
    if batch.values is None:
        raise ValueError("gae needs critic values (AdvantageBatch.values)")
    rollouts = _Rollouts.from_batch(batch)
    mask, values = batch.action_mask, batch.values.float()
    layout = _ActionLayout.build(mask, rollouts)
    packed = layout.pack(values[mask])
    next_values = torch.nn.functional.pad(packed[:, 1:], (0, 1))
    rewards = layout.token_rewards(batch, cfg, rollouts.rewards)
    raw = layout.discounted(rewards + cfg.gamma * next_values - packed, cfg.gamma * cfg.lam)
    returns = torch.where(mask, raw + values, torch.zeros_like(raw))
    advantages = whiten(raw, mask, cfg.eps) if cfg.whiten else raw
    means = {"value_mean": masked_mean(values, mask), "return_mean": masked_mean(returns, mask)}
    return _result(advantages, mask, returns, **means)


def on_policy_distill(batch: AdvantageBatch, cfg: AdvantageConfig) -> Advantages:
    """On-policy distillation: A_t = distill_coef * (log pi_teacher(y_t) - log pi(y_t)), per
    token a reverse-KL signal toward the teacher; the reward is unused."""
    if batch.teacher_logprobs is None or batch.logprobs is None:
        raise ValueError("on_policy_distill needs teacher_logprobs and logprobs in the batch")
    mask = batch.action_mask
    gap = batch.teacher_logprobs.float() - batch.logprobs.float()
    advantages = torch.where(mask, cfg.distill_coef * gap, torch.zeros_like(gap))
    return _result(advantages, mask, teacher_gap=masked_mean(gap, mask))


ADVANTAGE_ESTIMATORS = {
    "reinforce": Estimator(reinforce, Needs(kl_reward=True)),
    "reinforce_baseline": Estimator(reinforce, Needs(groups=True, kl_reward=True)),
    "rloo": Estimator(group_relative, Needs(groups=True)),
    "grpo": Estimator(group_relative, Needs(groups=True)),
    "dr_grpo": Estimator(group_relative, Needs(groups=True)),
    "flash_reinforce": Estimator(flash_reinforce, Needs()),
    "gae": Estimator(gae, Needs(critic=True, kl_reward=True)),
    "on_policy_distill": Estimator(on_policy_distill, Needs(reference=True)),
}
