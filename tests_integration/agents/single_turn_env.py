"""Single-turn Env: the reward is the reply's length in tokens, so it varies within a group."""

from molt_rollout import Env, EnvRunner, EnvState, Result


class LengthEnv(Env):
    async def step(self, state: EnvState) -> Result:
        return Result(reward=float(len(state.token_ids)), info={"turn": state.turn})


class AgentRunner(EnvRunner):
    env_class = LengthEnv
