"""The image task (colours.py) in the Env form: the row's image reaches the engine and the
trainer through the runner's processor; `step` scores the reply."""

from molt_rollout import Env, EnvRunner, EnvState, Result
from molt_train.quickstart.colours import colour_reward


class ColourEnv(Env):
    async def step(self, state: EnvState) -> Result:
        value = colour_reward(state.text, state.label)
        return Result(reward=value, score=value)


class AgentRunner(EnvRunner):
    env_class = ColourEnv
