"""Multi-turn Env with tool-like observations: three turns, each answered by a tool message."""

from molt_rollout import Env, EnvRunner, EnvState, Result


class ToolEnv(Env):
    async def step(self, state: EnvState) -> Result:
        if state.turn < 2:
            observation = [{"role": "tool", "content": f"result {state.turn}"}]
            return Result(reward=0.5, observation=observation, terminated=False)
        return Result(reward=1.0)


class AgentRunner(EnvRunner):
    env_class = ToolEnv
