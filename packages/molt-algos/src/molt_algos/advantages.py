"""Advantage estimators: rewards (and values, KL, teacher log-probs) in, per-token advantages out.

Layout. A batch is B rows padded to T tokens. A row is one *segment*: one token-exact context.
A rollout has one or more segments (context compaction opens a new one); its segments are the
rows sharing its `rollout_id`, in row order, and all carry the rollout's reward. Group
estimators count each rollout once and broadcast its advantage to every segment's action tokens.
Token-level estimators (reinforce, reinforce_baseline, gae) run over a rollout's action tokens
concatenated across its segments: tokens outside `action_mask` (prompt, tool observations) are
transparent, so returns, bootstrap values and running advantages pass straight through them.

Every estimator has the same signature, `(AdvantageBatch, AdvantageConfig) -> Advantages`, and
is selected by name through `ADVANTAGE_ESTIMATORS`.
"""

from dataclasses import dataclass
from typing import Literal

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
    """The estimator and its parameters, and the train/rollout IS correction
    (`--algo.advantage.*`; the correction is molt_algos.correction)."""

    estimator: EstimatorName = "grpo"  # the advantage estimator (docs/algorithms.md)
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


# Estimators that put KL into a per-token reward. The others produce one scalar per rollout
# (or a per-token teacher signal) and refuse kl_coef > 0: use KL as a loss term with them.
KL_IN_REWARD_ESTIMATORS = {"reinforce", "reinforce_baseline", "gae"}
# Estimators whose baseline comes from the other samples of the prompt: they need n > 1.
GROUP_ESTIMATORS = {"reinforce_baseline", "rloo", "grpo", "dr_grpo"}


def validate_advantage_config(cfg: AdvantageConfig) -> None:
    """Raise ValueError on an unknown estimator or a setting it cannot honour (the IS
    correction's settings: molt_algos.correction.validate_is_correction)."""
    estimator = cfg.estimator
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; choose one of {sorted(ADVANTAGE_ESTIMATORS)}"
        )
    if cfg.kl_coef != 0.0 and estimator not in KL_IN_REWARD_ESTIMATORS:
        raise ValueError(
            f"kl_coef={cfg.kl_coef} puts KL into the reward, which {estimator} cannot do (its "
            f"advantage is one scalar per rollout); use KL as a loss term, or one of "
            f"{sorted(KL_IN_REWARD_ESTIMATORS)}"
        )
    if not 0.0 <= cfg.gamma <= 1.0 or not 0.0 <= cfg.lam <= 1.0:
        raise ValueError(f"gamma={cfg.gamma} and lam={cfg.lam} must lie in [0, 1]")
    if cfg.eps <= 0.0:
        raise ValueError(f"eps={cfg.eps} must be positive")


def compute_advantages(batch: AdvantageBatch, cfg: AdvantageConfig) -> Advantages:
    validate_advantage_config(cfg)
    return ADVANTAGE_ESTIMATORS[cfg.estimator](batch, cfg)


# --- rollouts and groups ----------------------------------------------------------------------


@dataclass
class _Rollouts:
    """One entry per rollout: its reward and group, and which rollout each batch row belongs to."""

    of_row: Tensor  # [B] rollout index of each row
    rewards: Tensor  # [R]
    groups: Tensor  # [R] group index (0..G-1)

    @classmethod
    def from_batch(cls, batch: AdvantageBatch) -> "_Rollouts":
        _, of_row = torch.unique(batch.rollout_ids, return_inverse=True)
        num = int(of_row.max()) + 1 if of_row.numel() else 0
        first_row = torch.full((num,), of_row.numel(), dtype=torch.long, device=of_row.device)
        rows = torch.arange(of_row.numel(), device=of_row.device)
        first_row = first_row.scatter_reduce(0, of_row, rows, reduce="amin")
        rewards = batch.rewards.float()[first_row]
        if not torch.equal(rewards[of_row], batch.rewards.float()):
            raise ValueError("segments of one rollout (same rollout_id) carry different rewards")
        if not torch.equal(batch.group_ids[first_row][of_row], batch.group_ids):
            raise ValueError("segments of one rollout (same rollout_id) carry different group_ids")
        _, groups = torch.unique(batch.group_ids[first_row], return_inverse=True)
        return cls(of_row=of_row, rewards=rewards, groups=groups)

    def group_mean_std(self) -> tuple[Tensor, Tensor, Tensor]:
        """Per rollout: its group's mean reward, unbiased std (0 for a singleton) and size, in
        float64. A group whose rewards are all equal gets its reward as the mean and std 0
        exactly (a float mean could round off it, and eps would then magnify the rounding
        into an advantage), so every group baseline gives it exactly zero."""
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

    def broadcast(self, per_rollout: Tensor, action_mask: Tensor) -> Tensor:
        """[R] -> [B, T]: each rollout's value on every action token of every one of its segments."""
        per_row = per_rollout[self.of_row][:, None].expand_as(action_mask)
        return torch.where(action_mask, per_row, torch.zeros_like(per_row))


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
        position[order] = (
            torch.arange(order.numel(), device=order.device) - starts[rollout_of_token[order]]
        )
        return cls(action_mask, rollout_of_token, position, lengths)

    @property
    def width(self) -> int:
        return int(self.lengths.max()) if self.lengths.numel() else 0

    def pack(self, values: Tensor) -> Tensor:
        packed = values.new_zeros(self.lengths.numel(), self.width)
        packed[self.rollout_of_token, self.position] = values[self.action_mask]
        return packed

    def unpack(self, packed: Tensor) -> Tensor:
        out = packed.new_zeros(self.action_mask.shape)
        out[self.action_mask] = packed[self.rollout_of_token, self.position]
        return out

    def terminal_rewards(self, per_rollout: Tensor) -> Tensor:
        """[R] -> [R, L]: the scalar reward on each rollout's last action token."""
        packed = per_rollout.new_zeros(self.lengths.numel(), self.width)
        has_tokens = self.lengths > 0
        rows = torch.nonzero(has_tokens).squeeze(1)
        packed[rows, self.lengths[has_tokens] - 1] = per_rollout[has_tokens]
        return packed


def _reverse_discounted_sum(x: Tensor, discount: float) -> Tensor:
    """y_t = x_t + discount * y_{t+1} along the last dim of [R, L] (zero past the end)."""
    out = torch.zeros_like(x)
    running = x.new_zeros(x.shape[0])
    for t in range(x.shape[1] - 1, -1, -1):
        running = x[:, t] + discount * running
        out[:, t] = running
    return out


def _token_rewards(
    batch: AdvantageBatch, cfg: AdvantageConfig, layout: _ActionLayout, scalar: Tensor
) -> Tensor:
    """[R, L] per-token rewards: -kl_coef * kl_t on every action token, plus the rollout's
    scalar reward on its last action token."""
    rewards = layout.terminal_rewards(scalar)
    if cfg.kl_coef != 0.0:
        if batch.kl is None:
            raise ValueError(f"kl_coef={cfg.kl_coef} but the batch carries no per-token kl")
        rewards = rewards - cfg.kl_coef * layout.pack(batch.kl.float())
    return rewards


def _summary(advantages: Tensor, mask: Tensor, **extra: Tensor) -> dict[str, float]:
    low, high = masked_min_max(advantages, mask)
    metrics = {
        "advantage/mean": masked_mean(advantages, mask),
        "advantage/std": masked_std(advantages, mask),
        "advantage/min": low,
        "advantage/max": high,
    }
    metrics.update({f"advantage/{name}": value for name, value in extra.items()})
    return to_floats(metrics)


# --- group estimators: one scalar per rollout ---------------------------------------------------


def _group_advantages(
    batch: AdvantageBatch, per_rollout: Tensor, rollouts: _Rollouts
) -> Advantages:
    advantages = rollouts.broadcast(per_rollout.float(), batch.action_mask)
    return Advantages(advantages, None, _summary(advantages, batch.action_mask))


def grpo(batch: AdvantageBatch, cfg: AdvantageConfig) -> Advantages:
    """GRPO: A_i = (R_i - mean_g R) / (std_g R + eps), std unbiased (n - 1 denominator).

    A singleton group has std 0 and advantage 0.
    """
    rollouts = _Rollouts.from_batch(batch)
    mean, std, _ = rollouts.group_mean_std()
    per_rollout = (rollouts.rewards - mean) / (std + cfg.eps)
    return _group_advantages(batch, per_rollout, rollouts)


def dr_grpo(batch: AdvantageBatch, cfg: AdvantageConfig) -> Advantages:
    """Dr. GRPO: A_i = R_i - mean_g R. No std division (no difficulty bias), no whitening."""
    rollouts = _Rollouts.from_batch(batch)
    mean, _, _ = rollouts.group_mean_std()
    return _group_advantages(batch, rollouts.rewards - mean, rollouts)


def rloo(batch: AdvantageBatch, cfg: AdvantageConfig) -> Advantages:
    """RLOO: A_i = R_i - (1 / (n - 1)) sum_{j != i} R_j = n / (n - 1) (R_i - mean_g R).

    A singleton group has no other sample to form a baseline: its advantage is 0.
    """
    rollouts = _Rollouts.from_batch(batch)
    mean, std, count = rollouts.group_mean_std()
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    per_rollout = scale * (rollouts.rewards - mean)
    return _group_advantages(batch, per_rollout, rollouts)


def flash_reinforce(batch: AdvantageBatch, cfg: AdvantageConfig) -> Advantages:
    """FlashREINFORCE: A_i = R_i - mean_batch R, the mean over the batch's rollouts (each
    counted once, whatever its segments or group). No std division, no whitening; made for one
    rollout per prompt, so it needs no group. Metric `advantage/baseline`: the batch mean."""
    rollouts = _Rollouts.from_batch(batch)
    baseline = rollouts.rewards.mean() if rollouts.rewards.numel() else rollouts.rewards.sum()
    advantages = rollouts.broadcast(rollouts.rewards - baseline, batch.action_mask)
    metrics = _summary(advantages, batch.action_mask, baseline=baseline)
    return Advantages(advantages, None, metrics)


# --- token-level estimators: returns over a rollout's action tokens ---------------------------


def _discounted_return_advantages(
    batch: AdvantageBatch, cfg: AdvantageConfig, rollouts: _Rollouts, scalar: Tensor
) -> Advantages:
    layout = _ActionLayout.build(batch.action_mask, rollouts)
    token_rewards = _token_rewards(batch, cfg, layout, scalar)
    returns = layout.unpack(_reverse_discounted_sum(token_rewards, cfg.gamma))
    mask = batch.action_mask
    advantages = whiten(returns, mask, cfg.eps) if cfg.whiten else returns
    metrics = _summary(advantages, mask, return_mean=masked_mean(returns, mask))
    return Advantages(advantages, returns, metrics)


def reinforce(batch: AdvantageBatch, cfg: AdvantageConfig) -> Advantages:
    """REINFORCE++: per-token reward r_t = -beta * kl_t, plus R on the rollout's last action
    token; G_t = r_t + gamma * G_{t+1}; A_t = whiten(G)_t over the batch's action tokens
    (whitening off with `whiten=False`). Returns G are reported as `returns`."""
    rollouts = _Rollouts.from_batch(batch)
    return _discounted_return_advantages(batch, cfg, rollouts, rollouts.rewards)


def reinforce_baseline(batch: AdvantageBatch, cfg: AdvantageConfig) -> Advantages:
    """REINFORCE++ with a group baseline: R is replaced by R - mean_g R, then per-token KL
    reward, discounted returns and batch whitening as in `reinforce`."""
    rollouts = _Rollouts.from_batch(batch)
    mean, _, _ = rollouts.group_mean_std()
    baselined = (rollouts.rewards.double() - mean).float()
    return _discounted_return_advantages(batch, cfg, rollouts, baselined)


def gae(batch: AdvantageBatch, cfg: AdvantageConfig) -> Advantages:
    """GAE for a PPO critic, over a rollout's action tokens (masked tokens are transparent):
    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}, V past the
    last action token = 0 (terminal). r_t = -beta * kl_t, plus R on the last action token.
    Value targets (`returns`) = A + V, before whitening; `advantages` are whitened unless
    `whiten=False`."""
    if batch.values is None:
        raise ValueError("gae needs critic values (AdvantageBatch.values)")
    rollouts = _Rollouts.from_batch(batch)
    layout = _ActionLayout.build(batch.action_mask, rollouts)
    values = layout.pack(batch.values.float())
    next_values = torch.nn.functional.pad(values[:, 1:], (0, 1))
    deltas = _token_rewards(batch, cfg, layout, rollouts.rewards) + cfg.gamma * next_values - values
    raw = layout.unpack(_reverse_discounted_sum(deltas, cfg.gamma * cfg.lam))
    mask = batch.action_mask
    returns = torch.where(mask, raw + batch.values.float(), torch.zeros_like(raw))
    advantages = whiten(raw, mask, cfg.eps) if cfg.whiten else raw
    metrics = _summary(
        advantages,
        mask,
        value_mean=masked_mean(batch.values.float(), mask),
        return_mean=masked_mean(returns, mask),
    )
    return Advantages(advantages, returns, metrics)


def on_policy_distill(batch: AdvantageBatch, cfg: AdvantageConfig) -> Advantages:
    """On-policy distillation: A_t = beta * (log pi_teacher(y_t) - log pi_student(y_t)) on each
    action token: a per-token reverse-KL signal toward the teacher. The scalar reward is unused."""
    if batch.teacher_logprobs is None or batch.logprobs is None:
        raise ValueError("on_policy_distill needs teacher_logprobs and logprobs in the batch")
    mask = batch.action_mask
    gap = batch.teacher_logprobs.float() - batch.logprobs.float()
    advantages = torch.where(mask, cfg.distill_coef * gap, torch.zeros_like(gap))
    metrics = _summary(advantages, mask, teacher_gap=masked_mean(gap, mask))
    return Advantages(advantages, None, metrics)


ADVANTAGE_ESTIMATORS = {
    "reinforce": reinforce,
    "reinforce_baseline": reinforce_baseline,
    "rloo": rloo,
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "flash_reinforce": flash_reinforce,
    "gae": gae,
    "on_policy_distill": on_policy_distill,
}
