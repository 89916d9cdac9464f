"""A one-turn Env whose reward depends on the sampled tokens: the share of even token ids in the
reply (the GPU rollout benchmark's task; any random model earns about 0.5 and can learn more)."""

from molt_rollout import Env, EnvRunner, EnvState, Result


class EvenTokens(Env):
    async def step(self, state: EnvState) -> Result:
        ids = state.token_ids
        value = sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1)
        return Result(reward=value, score=value)


class AgentRunner(EnvRunner):
    env_class = EvenTokens
