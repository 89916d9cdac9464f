"""The quickstart task in the Env form: Molt generates the reply, `step` scores it.

Single turn: the prompt shows one half of the alphabet, the reply is scored once and the
rollout ends. See `reward.py` for the rule and `__init__.py` for the task.
"""

from molt_rollout import Env, EnvRunner, EnvState, Result
from molt_train.quickstart.reward import reward


class HalfEnv(Env):
    async def step(self, state: EnvState) -> Result:
        value = reward(state.text, state.label)
        return Result(reward=value, score=value)


class AgentRunner(EnvRunner):
    env_class = HalfEnv
