"""reasoning-gym tasks, several in one run, each scored by its own dataset's `score_answer`.

reasoning-gym generates its problems from a seed (nothing to download). Write the prompt rows
once, then train on them:

    python -m molt_examples.reasoning_gym_env --tasks leg_counting basic_arithmetic \\
        --size 2000 --seed 0 --out rg_train.jsonl
    molt-train --train.agent_path molt_examples.reasoning_gym_env --data.train_files rg_train.jsonl

A row keeps its task, the dataset's settings and its index, so the runner rebuilds the exact
entry (with the metadata its scorer reads) instead of trusting a JSON copy of it. Each row's
`data_source` is its task: evaluation reports `eval/<task>/pass@1`, and training logs
`rollout/info/reward/<task>` (docs/environments/reasoning_gym_env.md).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import reasoning_gym
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from molt_rollout import Env, EnvRunner, EnvState, Result


def make_rows(tasks: list[str], size: int, seed: int, config: dict | None = None) -> list[dict]:
    """`size` problems of each task, interleaved; `config` maps a task to its dataset settings
    (e.g. {"basic_arithmetic": {"max_terms": 3}})."""
    per_task = []
    for task in tasks:
        settings = {**(config or {}).get(task, {}), "size": size, "seed": seed}
        dataset = reasoning_gym.create_dataset(task, **settings)
        per_task.append([prompt_row(task, settings, i, dataset[i]) for i in range(size)])
    return [r for rows in zip(*per_task, strict=True) for r in rows]


def prompt_row(task: str, settings: dict, index: int, entry: dict) -> dict:
    return {
        # reasoning-gym's own instruction: think, then the answer inside <answer></answer>
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPTS["default"]},
            {"role": "user", "content": entry["question"]},
        ],
        "label": entry["answer"],  # for reading; the scorer gets the rebuilt entry
        "data_source": task,
        "reasoning_gym": {"task": task, "settings": settings, "index": index},
    }


@functools.lru_cache(maxsize=64)
def dataset(task: str, settings_json: str):
    return reasoning_gym.create_dataset(task, **json.loads(settings_json))


@functools.lru_cache(maxsize=4096)
def entry(task: str, settings_json: str, index: int) -> dict:
    return dataset(task, settings_json)[index]  # the n rollouts of a prompt share it


def score(reply: str, source: dict[str, Any]) -> tuple[float, bool]:
    """(the task's score of the reply's <answer>, whether the reply had one)."""
    settings_json = json.dumps(source["settings"], sort_keys=True)
    item = entry(source["task"], settings_json, source["index"])
    answer = extract_answer(reply)  # the last <answer>...</answer>, None without one
    value = dataset(source["task"], settings_json).score_answer(answer, item)
    return float(value), answer is not None


class ReasoningGymEnv(Env):
    async def step(self, state: EnvState) -> Result:
        # The reply's content: a thinking model's reasoning is parsed out of it.
        reply = state.reply.content if state.reply is not None else state.text
        # Inline on the runner's event loop: the scorers are small pure-Python checks.
        value, answered = score(reply, state.row["reasoning_gym"])
        task = state.row["reasoning_gym"]["task"]
        # Each rollout reports its own task's key: the logs average it over that task only.
        info = {f"reward/{task}": value, "answered": float(answered)}
        return Result(reward=value, score=value, info=info)


class AgentRunner(EnvRunner):
    env_class = ReasoningGymEnv


def main() -> None:
    parser = argparse.ArgumentParser(description="Write reasoning-gym prompt rows (JSONL).")
    parser.add_argument("--tasks", nargs="+", required=True, help="reasoning-gym dataset names")
    parser.add_argument("--size", type=int, default=1000, help="problems per task")
    parser.add_argument("--seed", type=int, default=0, help="another seed for the eval rows")
    parser.add_argument("--config", type=json.loads, default={}, help='{"task": {settings}}')
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = make_rows(args.tasks, args.size, args.seed, args.config)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} rows of {', '.join(args.tasks)} -> {args.out}")


if __name__ == "__main__":
    main()
