"""Per-step statistics of a batch of rollouts (`rollout/*`, docs/reference/metrics.md), and a
few of them decoded. Population standard deviations: a group of one has std 0."""

from __future__ import annotations

from collections import defaultdict
from itertools import compress, zip_longest
from statistics import fmean, pstdev
from typing import Any

from molt_capture.types import Rollout, Segment


def rollout_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """`rollout/*` statistics over one batch's rollouts (the pool counts the dropped ones)."""
    if not rollouts:
        return {}
    group_rewards = [[r.reward for r in group] for group in _by_group(rollouts)]
    response_lengths = [sum(seg.num_generated for seg in r.segments) for r in rollouts]
    metrics = {
        "rollout/count": float(len(rollouts)),
        "rollout/groups": float(len(group_rewards)),
        "rollout/reward_mean": fmean(r.reward for r in rollouts),
        "rollout/reward_std": pstdev(r.reward for r in rollouts),
        "rollout/group_reward_std_mean": fmean(pstdev(g) for g in group_rewards),
        # All rewards equal (not std == 0.0, which float rounding can miss).
        "rollout/zero_std_groups": fmean(min(g) == max(g) for g in group_rewards),
        "rollout/score_mean": fmean(r.reward if r.score is None else r.score for r in rollouts),
        "rollout/response_length_mean": fmean(response_lengths),
        "rollout/response_length_max": float(max(response_lengths)),
        "rollout/prompt_length_mean": fmean(_prompt_length(r.segments[0]) for r in rollouts),
        "rollout/truncated_rate": fmean(is_truncated(r) for r in rollouts),
        "rollout/turns_mean": fmean(sum(len(seg.turns) for seg in r.segments) for r in rollouts),
        "rollout/segments_mean": fmean(len(r.segments) for r in rollouts),
    }
    metrics |= _key_means("rollout/info/", [r.info for r in rollouts])
    metrics |= _key_means("rollout/time/", [r.timings for r in rollouts])
    return metrics


def sample_rows(
    rollouts: list[Rollout], tokenizer, k: int, current_version: int | None = None
) -> list[dict[str, Any]]:
    """Up to `k` rollouts decoded (prompt, then the rest as a transcript), one per group first."""
    ranks = zip_longest(*_by_group(rollouts))  # each group's first rollout, then its second, ...
    rows = []
    for r in [r for rank in ranks for r in rank if r is not None][:k]:
        seg = r.segments[0]
        start = _prompt_length(seg)
        row = {
            "prompt": tokenizer.decode(seg.token_ids[:start]),
            "response": tokenizer.decode(seg.token_ids[start:]),
            "reward": r.reward,
        }
        if r.score is not None:
            row["score"] = r.score
        versions = (v for s in r.segments for v in compress(s.weight_versions, s.trainable))
        oldest = min(versions, default=None)
        if current_version is not None and oldest is not None:
            row["version_lag"] = current_version - oldest
        rows.append(row)
    return rows


def _by_group(rollouts: list[Rollout]) -> list[list[Rollout]]:
    groups: dict[str, list[Rollout]] = defaultdict(list)
    for r in rollouts:
        groups[r.group_id].append(r)
    return list(groups.values())


def _prompt_length(seg: Segment) -> int:
    """Tokens before the first generated one (the whole segment if nothing was generated)."""
    return seg.turns[0].start if seg.turns else len(seg)


def is_truncated(r: Rollout) -> bool:
    """Cut rather than finished: a full context, or a last turn that hit its token limit."""
    last_turn = r.segments[-1].turns[-1] if r.segments[-1].turns else None
    length_cut = last_turn is not None and last_turn.finish_reason == "length"
    return length_cut or any(seg.truncated for seg in r.segments)


def _key_means(prefix: str, dicts: list[dict[str, Any]]) -> dict[str, float]:
    """Mean of each numeric key over the dicts that have it; other values are skipped."""
    values: dict[str, list[float]] = defaultdict(list)
    for d in dicts:
        for key, value in d.items():
            if isinstance(value, int | float):
                values[key].append(float(value))
    return {prefix + key: fmean(v) for key, v in values.items()}
