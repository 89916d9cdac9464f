"""Evaluation: a separate, non-streaming pass over the eval rows, and its pass@k metrics. A
rollout is correct when its score (else its reward) reaches the threshold; a dropped one is not."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from molt_rollout.agents.pool import GroupResult, Launch, PromptTask
from molt_rollout.config import RolloutConfig, at_least


@dataclass
class EvalConfig:
    """When and how to evaluate (`--eval.*`); sampling here replaces the training sampling."""

    every_steps: int = 0  # 0 = never
    n_samples: int = 4  # samples per prompt; pass@k for every power of 2 up to n, and n
    temperature: float = 1.0  # eval sampling temperature (0: greedy)
    top_p: float = 1.0  # eval nucleus sampling
    max_tokens: int | None = None  # per turn; None: the training's (--rollout.max_tokens)
    max_prompts: int | None = None  # the first rows of the eval files only


def validate_eval_config(cfg: EvalConfig) -> None:
    at_least("eval", cfg, ("every_steps",), 0)  # 0: never
    at_least("eval", cfg, ("n_samples", "max_tokens", "max_prompts"), 1)
    if cfg.temperature < 0 or not 0 < cfg.top_p <= 1:
        raise ValueError("--eval.temperature must be >= 0 and --eval.top_p in (0, 1]")


def eval_rollout_config(base: RolloutConfig, cfg: EvalConfig) -> RolloutConfig:
    """The training rollouts' config with the eval's sampling, for the runners that evaluate."""
    max_tokens = base.max_tokens if cfg.max_tokens is None else cfg.max_tokens
    sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": max_tokens}
    return dataclasses.replace(base, **sampling)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of the chance that at least one of k samples is correct, from n
    samples of which c are correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    # Exact integers: the float form of the binomials overflows for large n.
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """The k reported for n samples: every power of 2 up to n, and n itself."""
    return sorted({2**i for i in range(n.bit_length())} | {n})


def eval_metrics(results: list[GroupResult], threshold: float = 1.0) -> dict[str, float]:
    """`eval/<source>/<metric>` per `row["data_source"]` and `eval/<metric>` over all prompts:
    pass@k (over prompts with >= k samples), reward_mean (finished rollouts), num_prompts, dropped."""
    by_source: dict[str, list[GroupResult]] = defaultdict(list)
    for result in results:
        by_source[str(result.task.row.get("data_source", "unknown"))].append(result)
    metrics: dict[str, float] = {}
    for source in sorted(by_source):
        metrics.update(_metrics(by_source[source], threshold, f"eval/{source}/"))
    if results:
        metrics.update(_metrics(results, threshold, "eval/"))
    return metrics


def _metrics(results: list[GroupResult], threshold: float, prefix: str) -> dict[str, float]:
    def correct(x: Any) -> bool:
        return (x.reward if x.score is None else x.score) >= threshold

    # Dropped rollouts are samples too: counting only the finished ones would reward failing.
    samples = [(len(r.rollouts) + len(r.dropped), sum(map(correct, r.rollouts))) for r in results]
    metrics = {}
    for k in pass_ks(max(n for n, _ in samples)):
        values = [pass_at_k(n, c, k) for n, c in samples if n >= k]
        metrics[f"{prefix}pass@{k}"] = sum(values) / len(values)
    rewards = [x.reward for r in results for x in r.rollouts]
    metrics[f"{prefix}reward_mean"] = sum(rewards) / len(rewards) if rewards else math.nan
    metrics[f"{prefix}num_prompts"] = float(len(results))
    metrics[f"{prefix}dropped"] = float(sum(len(r.dropped) for r in results))
    return metrics


def run_eval(rows: list[dict[str, Any]], launch: Launch, cfg: EvalConfig) -> list[GroupResult]:
    """Launch a group per eval row at once and wait for all (the runners' deadlines bound it)."""
    # Negative prompt indices and `eval-<i>` ids never collide with training prompts.
    tasks = [
        PromptTask(-1 - i, row, f"eval-{i}", cfg.n_samples, for_eval=True)
        for i, row in enumerate(rows[: cfg.max_prompts])
    ]
    return [future.result() for future in [launch(task) for task in tasks]]
