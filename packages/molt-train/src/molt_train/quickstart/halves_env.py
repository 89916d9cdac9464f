"""The quickstart task in the Env form: Molt generates the one-turn reply, `step` scores it."""

from molt_rollout import Env, EnvRunner, EnvState, Result
from molt_train.quickstart.reward import reward


class HalfEnv(Env):
    async def step(self, state: EnvState) -> Result:
        value = reward(state.text, state.label)
        return Result(reward=value, score=value)


class AgentRunner(EnvRunner):
    env_class = HalfEnv
