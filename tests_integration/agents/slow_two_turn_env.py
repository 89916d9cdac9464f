"""Two turns with a slow tool in between: the trainer refits while rollouts wait on the tool,
so their second turn is sampled by newer weights than their first."""

import asyncio

from molt_rollout import Env, EnvRunner, EnvState, Result


class SlowToolEnv(Env):
    async def step(self, state: EnvState) -> Result:
        if state.turn == 0:
            await asyncio.sleep(3.0)  # a slow tool call
            return Result(reward=0.0, observation=[{"role": "tool", "content": "done"}],
                          terminated=False)  # fmt: skip
        return Result(reward=float(len(state.text) % 2))


class AgentRunner(EnvRunner):
    env_class = SlowToolEnv
