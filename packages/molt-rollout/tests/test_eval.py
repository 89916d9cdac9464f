"""Evaluation: pass@k against brute force, metrics per data source, the eval pass."""

from __future__ import annotations

import itertools
import math
import threading
from concurrent.futures import Future

import pytest

from molt_capture.types import Rollout
from molt_rollout.agents.agent import Dropped
from molt_rollout.agents.eval import (
    EvalConfig,
    eval_metrics,
    eval_rollout_config,
    pass_at_k,
    pass_ks,
    run_eval,
    validate_eval_config,
)
from molt_rollout.agents.pool import GroupResult, PromptTask
from molt_rollout.config import RolloutConfig


def brute_force_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The fraction of k-subsets of the samples that hold at least one correct one."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_equals_brute_force(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(outcomes, k))


def test_pass_at_k_edges():
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert 0.0 < pass_at_k(2000, 3, 1000) <= 1.0  # exact integers: no overflow
    for bad in [(4, 5, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(*bad)
    assert [pass_ks(n) for n in (1, 4, 6, 16)] == [[1], [1, 2, 4], [1, 2, 4, 6], [1, 2, 4, 8, 16]]


def rollout(reward: float, score: float | None = None) -> Rollout:
    return Rollout(segments=[], reward=reward, rollout_id="r", group_id="g", score=score)


def dropped() -> Dropped:
    return Dropped("deadline", "too slow", "r", "g", 1.0)


def group(source: str, rollouts: list[Rollout], n_dropped: int = 0) -> GroupResult:
    n = len(rollouts) + n_dropped
    task = PromptTask(prompt_index=0, row={"prompt": "q", "data_source": source}, group_id="g", n=n)
    return GroupResult(task, rollouts, [dropped() for _ in range(n_dropped)])


def test_metrics_per_source_and_overall():
    results = [
        group("math", [rollout(1.0), rollout(0.0), rollout(0.0), rollout(0.0)]),  # c=1 of 4
        group("math", [rollout(1.0), rollout(1.0)], n_dropped=2),  # c=2 of 4
        # The score decides when there is one; otherwise the reward does.
        group("code", [rollout(0.3, score=1.0), rollout(1.0, score=0.0), rollout(0.5)], 1),
    ]
    m = eval_metrics(results)
    assert m["eval/math/pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert m["eval/math/pass@2"] == pytest.approx((pass_at_k(4, 1, 2) + pass_at_k(4, 2, 2)) / 2)
    assert m["eval/math/pass@4"] == 1.0
    assert m["eval/math/reward_mean"] == pytest.approx(3 / 6)  # over finished rollouts
    assert (m["eval/math/num_prompts"], m["eval/math/dropped"]) == (2.0, 2.0)
    assert m["eval/code/pass@1"] == 0.25 and m["eval/code/dropped"] == 1.0
    assert m["eval/pass@1"] == pytest.approx((1 / 4 + 2 / 4 + 1 / 4) / 3)
    assert m["eval/num_prompts"] == 3.0 and m["eval/dropped"] == 3.0
    assert m["eval/reward_mean"] == pytest.approx((3 + 1.8) / 9)
    assert set(m) == {
        f"eval/{s}{name}"
        for s in ("", "math/", "code/")
        for name in ("pass@1", "pass@2", "pass@4", "reward_mean", "num_prompts", "dropped")
    }


def test_metrics_threshold_and_edge_cases():
    results = [group("x", [rollout(0.6), rollout(0.4)])]
    assert eval_metrics(results, threshold=0.5)["eval/x/pass@1"] == 0.5
    assert eval_metrics(results)["eval/x/pass@1"] == 0.0
    all_dropped = eval_metrics([group("x", [], n_dropped=2)])
    assert all_dropped["eval/x/pass@2"] == 0.0 and math.isnan(all_dropped["eval/x/reward_mean"])
    # A group with fewer samples counts only towards the k it has.
    mixed = eval_metrics([group("x", [rollout(1.0)]), group("x", [rollout(0.0)] * 2)])
    assert mixed["eval/x/pass@1"] == 0.5 and mixed["eval/x/pass@2"] == 0.0
    unnamed = GroupResult(PromptTask(0, {"prompt": "q"}, "g", 1), [rollout(1.0)])
    assert eval_metrics([unnamed])["eval/unknown/pass@1"] == 1.0
    assert eval_metrics([]) == {}


def test_run_eval_launches_every_prompt_once_and_waits():
    rows = [{"prompt": f"q{i}", "data_source": "s", "label": i} for i in range(5)]
    tasks = []

    def launch(task: PromptTask) -> Future:
        tasks.append(task)
        future = Future()
        correct = task.row["label"] % 2 == 0
        result = GroupResult(task, [rollout(float(correct)) for _ in range(task.n)])
        # Finish on another thread, later, as a Ray actor would.
        threading.Timer(0.01, future.set_result, [result]).start()
        return future

    cfg = EvalConfig(n_samples=3, max_prompts=4)
    results = run_eval(rows, launch, cfg)
    assert [r.task.row["label"] for r in results] == [0, 1, 2, 3]  # in row order
    assert [t.group_id for t in tasks] == ["eval-0", "eval-1", "eval-2", "eval-3"]
    assert [t.prompt_index for t in tasks] == [-1, -2, -3, -4]  # training counts from 0
    assert all(t.n == 3 and t.attempt == 0 for t in tasks)
    assert eval_metrics(results)["eval/s/pass@1"] == 0.5


def test_eval_config():
    validate_eval_config(EvalConfig(every_steps=10))
    for bad, flag in [
        (EvalConfig(every_steps=-1), "--eval.every_steps"),
        (EvalConfig(n_samples=0), "--eval.n_samples"),
        (EvalConfig(top_p=0.0), "--eval.top_p"),
        (EvalConfig(max_tokens=0), "--eval.max_tokens"),
    ]:
        with pytest.raises(ValueError, match=flag):
            validate_eval_config(bad)
    base = RolloutConfig(temperature=1.0, max_tokens=512, max_turns=3)
    cfg = eval_rollout_config(base, EvalConfig(temperature=0.6, top_p=0.95, max_tokens=64))
    assert (cfg.temperature, cfg.top_p, cfg.max_tokens, cfg.max_turns) == (0.6, 0.95, 64, 3)
    assert eval_rollout_config(base, EvalConfig()).max_tokens == 512  # None: the training's
