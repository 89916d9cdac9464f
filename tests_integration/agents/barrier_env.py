"""An Env whose step waits until all four rollouts of its prompt are inside `step`: a group
finishes promptly only if its rollouts run concurrently. The reward is how many were waiting."""

import asyncio
from collections import Counter

from molt_rollout import Env, EnvRunner, EnvState, Result

GROUP_SIZE = 4
_inside: Counter[str] = Counter()  # per prompt, in this runner process


class BarrierEnv(Env):
    async def step(self, state: EnvState) -> Result:
        prompt = state.row["prompt"][-1]["content"]
        _inside[prompt] += 1
        for _ in range(300):  # 30 s, then give up with what has arrived
            if _inside[prompt] >= GROUP_SIZE:
                break
            await asyncio.sleep(0.1)
        return Result(reward=float(_inside[prompt]))


class AgentRunner(EnvRunner):
    env_class = BarrierEnv
