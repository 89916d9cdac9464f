"""Math word problems scored by math-verify: the reply's final answer against the dataset's gold
answer, compared as mathematics (1/2 == 0.5 == \\frac{1}{2}), not as text.

Reads the rows as users download them, through Molt's column remapping:

    GSM8K {"question", "answer": "... #### 42"}  --data.prompt_key question --data.label_key answer
    MATH  {"problem", "solution": "... \\boxed{}"}  --data.prompt_key problem --data.label_key solution
    DAPO-style {"prompt", "answer"}                --data.label_key answer
    DAPO-Math-17k {"prompt": [messages], "reward_model": {"ground_truth": ...}}
                                                   --data.label_key reward_model

Load it by module name (the scoring processes import it): --train.agent_path molt_examples.math_env
(docs/environments/math_env.md).
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from math_verify import parse, verify

from molt_rollout import Env, EnvRunner, EnvState, Result, RolloutDropped

# Appended to a prompt that is a bare question (a string): the form math-verify reads best.
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def gold_text(label: Any) -> str:
    """The reference answer of a GSM8K, MATH or DAPO-style label, as text math-verify parses."""
    if isinstance(label, dict):  # DAPO-Math-17k keeps it in reward_model.ground_truth
        label = label.get("ground_truth", "")
    text = str(label).strip()
    if "####" in text:  # GSM8K: a worked solution whose last line is "#### <number>"
        return "\\boxed{" + text.rsplit("####", 1)[1].strip() + "}"
    if "\\boxed" in text:  # MATH: a worked solution with the answer boxed
        return text
    return "\\boxed{" + text.strip("$ ") + "}"  # a bare answer: "42", "\\frac{1}{2}"


@functools.lru_cache(maxsize=4096)
def parse_gold(label_text: str) -> list:
    return parse(label_text)  # the n rollouts of a prompt share one gold answer


def score(reply: str, label_text: str) -> tuple[float, bool]:
    """(reward, whether the reply had a parseable answer). Runs in the scoring process."""
    answer = parse(reply)  # a boxed answer first, else the last number or expression
    gold = parse_gold(label_text)
    return float(bool(answer) and bool(gold) and verify(gold, answer)), bool(answer)


def with_instruction(row: dict, instruction: str) -> dict:
    """A bare question gets the instruction; a chat prompt (a list of messages, as
    DAPO-Math-17k's, which carry their own) is taken as written."""
    if instruction and isinstance(row.get("prompt"), str):
        return {**row, "prompt": f"{row['prompt']}\n\n{instruction}"}
    return row


class Scorer:
    """`score` in processes of its own, shared by a runner and its eval copy. math-verify bounds
    a slow sympy call with SIGALRM, which works only in a process's main thread; the runner's
    event loop is a Ray worker thread, and must not block on sympy either."""

    def __init__(self, processes: int):
        self.processes, self.pool = processes, None  # started on the first reply

    async def __call__(self, reply: str, label_text: str) -> tuple[float, bool]:
        if self.pool is None:  # spawned, not forked: the runner process has threads
            spawn = multiprocessing.get_context("spawn")
            self.pool = ProcessPoolExecutor(self.processes, mp_context=spawn)
        pool = self.pool
        try:
            return await asyncio.wrap_future(pool.submit(score, reply, label_text))
        except BrokenProcessPool as e:  # a scoring process died (out of memory, killed)
            if self.pool is pool:
                self.pool = None  # the next reply starts a fresh pool
            raise RolloutDropped("scorer_died", repr(e)) from e

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


class MathEnv(Env):
    def __init__(self, scorer: Scorer):
        self.scorer = scorer

    async def step(self, state: EnvState) -> Result:
        # The reply's content: a thinking model's reasoning is parsed out of it.
        reply = state.reply.content if state.reply is not None else state.text
        reward, parsed = await self.scorer(reply, gold_text(state.label))
        return Result(reward=reward, score=reward, info={"parsed": float(parsed)})


class AgentRunner(EnvRunner):
    env_class = MathEnv
    instruction = INSTRUCTION  # "" sends the dataset's prompts unchanged
    scoring_processes = 2  # per runner; scoring a reply takes milliseconds

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scorer = Scorer(self.scoring_processes)

    def make_env(self) -> Env:
        return MathEnv(self.scorer)

    async def run(self, row: dict, rollout_id: str, group_id: str):
        return await super().run(with_instruction(row, self.instruction), rollout_id, group_id)

    def close(self) -> None:
        self.scorer.close()
        super().close()
