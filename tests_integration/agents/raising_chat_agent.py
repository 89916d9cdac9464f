"""A ChatAgent (stock OpenAI SDK) that raises after its model call on rows marked `fail`:
those rollouts are dropped as agent_error, their tokens never trained."""

from openai import AsyncOpenAI

from molt_rollout import ChatAgent, ChatContext, ChatRunner, Result


class RaisingAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        await client.chat.completions.create(model=ctx.model, messages=ctx.messages, max_tokens=4)
        if ctx.row.get("fail"):
            raise RuntimeError("the agent's tool broke")
        return Result(reward=1.0)


class AgentRunner(ChatRunner):
    agent_class = RaisingAgent
