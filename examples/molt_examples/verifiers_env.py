"""Train on a `verifiers` environment as it is: its tasks become Molt prompt rows, its episodes
run against Molt's capture server, and its rubric (the task's `@vf.reward` functions) gives the
reward.

verifiers 0.4.0 (`import verifiers.v1 as vf`) runs an episode as an agent (a harness program,
e.g. the `null` chat loop or `bash`, in a runtime) whose model calls go through verifiers' own
interception server to an OpenAI-compatible endpoint. Here that endpoint is the rollout's capture
session (`ctx.base_url`), so every token the policy generates in the episode is recorded
token-exact and trained, with the episode's reward.

Rows: `python -m molt_examples.verifiers_env TASKSET_ID OUT.jsonl [--num-tasks N] [--config
JSON]` writes one row per task: the task's prompt as chat messages (what the logs show), and
under `verifiers` the env config and the task's data, from which the agent rebuilds the task.
Rows of several environments mix in one run (`--data.train_files a.jsonl b.jsonl`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from statistics import fmean

import verifiers.v1 as vf
from verifiers.v1.clients import EvalClientConfig, ModelContext

from molt_rollout import ChatAgent, ChatContext, ChatRunner, Result, RolloutDropped

# Training runs the harness on this machine unless the config names another runtime; a
# config's own `agent` settings win. verifiers' default is a remote sandbox.
LOCAL_AGENT = {"runtime": {"type": "subprocess"}}


def env_config(taskset_id: str, overrides: dict | None = None) -> dict:
    """The env config (verifiers' `[env]` block) of a taskset, run locally by default."""
    config = {"taskset": {"id": taskset_id}, "agent": dict(LOCAL_AGENT)}
    for key, value in (overrides or {}).items():
        merged = {**config[key], **value} if isinstance(config.get(key), dict) else value
        config[key] = merged
    return config


def load_env(config: dict) -> vf.Env:
    return vf.load_environment(vf.resolve_env_config(config))


def task_messages(data: vf.TaskData) -> list[dict]:
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str) or data.prompt is None:
        return [*system, {"role": "user", "content": data.prompt or ""}]
    return [*system, *(m.model_dump(mode="json", exclude_none=True) for m in data.prompt)]


def make_rows(config: dict, num_tasks: int | None = None) -> list[dict]:
    """One Molt row per task of the env's taskset (the first `num_tasks`)."""
    env = load_env(config)
    tasks = env.taskset if num_tasks is None else env.taskset.take(num_tasks)
    spec = env.config.model_dump(mode="json")
    return [
        {
            "prompt": task_messages(task.data),
            "data_source": env.config.env_id,
            "verifiers": {"env": spec, "task": task.data.model_dump(mode="json")},
        }
        for task in tasks
    ]


# One loaded env per config, per runner process and event loop, kept inside `env.serving()`
# (its interception server and shared tool servers) for the process's life.
_envs: dict[tuple, asyncio.Future] = {}
_holders: set[asyncio.Task] = set()


async def serving_env(config: dict) -> vf.Env:
    key = (json.dumps(config, sort_keys=True), id(asyncio.get_running_loop()))
    if key not in _envs:
        _envs[key] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(_serve(key, config))
        _holders.add(task)
        task.add_done_callback(_holders.discard)
    return await asyncio.shield(_envs[key])


async def _serve(key: tuple, config: dict) -> None:
    """Enters and leaves `serving()` in one task of its own (no rollout lives that long)."""
    ready = _envs[key]
    try:
        env = load_env(config)
        async with env.serving():
            ready.set_result(env)
            await asyncio.Event().wait()  # forever: the process's exit ends it
    except Exception as e:
        if not ready.done():
            ready.set_exception(e)
    finally:
        _envs.pop(key, None)


class VerifiersAgent(ChatAgent):
    """One episode of the row's env and task, its model the rollout's capture session."""

    async def run(self, ctx: ChatContext) -> Result:
        spec = ctx.row["verifiers"]
        env = await serving_env(spec["env"])
        task_class = type(env.taskset).task_type()
        data = task_class.data_type().model_validate(spec["task"])
        task = task_class(data, env.taskset.config.task)
        sampling = {"temperature": ctx.temperature, "top_p": ctx.top_p}
        if ctx.max_tokens is not None:
            sampling["max_tokens"] = ctx.max_tokens
        model = ModelContext(
            model=ctx.model,
            # Any key: the session id in the URL is the capability.
            client=EvalClientConfig(base_url=ctx.base_url, api_key_var="MOLT_VERIFIERS_KEY"),
            sampling=vf.SamplingConfig(**sampling),
        )
        episode = await env.run_episode(task, model)
        if not episode.ok:  # an env, harness or runtime failure: not the policy's result
            errors = episode.errors + [e for t in episode.traces for e in t.errors]
            detail = f"{errors[-1].type}: {errors[-1].message}" if errors else "not ok"
            raise RolloutDropped("verifiers_error", detail[:500])
        return episode_result(episode)


def episode_result(episode) -> Result:
    """The reward of the episode's trainable traces (their mean), each named reward and
    metric as info (logged as rollout/info/<name>)."""
    traces = [t for t in episode.traces if t.agent.trainable] or episode.traces
    reward = fmean(t.reward for t in traces)
    info: dict[str, float] = {"episode_turns": float(episode.num_turns)}
    for trace in traces:
        scores = {f"reward_{k}": r.score for k, r in trace.rewards.items() if r is not None}
        metrics = {f"metric_{k}": v for k, v in trace.metrics.items() if v is not None}
        info |= scores | metrics
    truncated = any(t.is_timeout for t in traces)
    return Result(reward=reward, score=reward, info=info, truncated=truncated)


class AgentRunner(ChatRunner):
    agent_class = VerifiersAgent


def main() -> None:
    parser = argparse.ArgumentParser(description="Write Molt rows for a verifiers taskset.")
    parser.add_argument("taskset_id", help="installed taskset, e.g. reverse-text")
    parser.add_argument("out", type=Path, help="the .jsonl file to write")
    parser.add_argument("--num-tasks", type=int, default=None)
    parser.add_argument("--config", type=json.loads, default={}, help="env config overrides")
    args = parser.parse_args()
    rows = make_rows(env_config(args.taskset_id, args.config), args.num_tasks)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
