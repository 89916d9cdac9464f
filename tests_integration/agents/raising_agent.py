"""An Env whose step raises on every other group: those rollouts are dropped as agent_error."""

from molt_rollout import Env, EnvRunner, EnvState, Result


class RaisingEnv(Env):
    async def step(self, state: EnvState) -> Result:
        if state.row.get("fail"):
            raise RuntimeError("the environment broke")
        return Result(reward=1.0)


class AgentRunner(EnvRunner):
    env_class = RaisingEnv
