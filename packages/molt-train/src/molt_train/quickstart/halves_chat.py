"""The quickstart task as a ChatAgent: one call through the stock OpenAI SDK.

The same task and reward as `halves_env.py`; the model is reached through `ctx.base_url`, the
runner's capture session, so every generated token is recorded exactly as in the Env form.
"""

from molt_rollout import ChatAgent, ChatContext, ChatRunner, Result
from molt_train.quickstart.reward import reward


class HalfAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = ctx.openai_client()  # the stock AsyncOpenAI at ctx.base_url, built cheaply
        response = await client.chat.completions.create(
            model=ctx.model,
            messages=ctx.messages,
            max_tokens=ctx.max_tokens,
            temperature=ctx.temperature,
        )
        value = reward(response.choices[0].message.content or "", ctx.label)
        return Result(reward=value, score=value)


class AgentRunner(ChatRunner):
    agent_class = HalfAgent
