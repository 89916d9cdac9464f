"""ChatAgent that compacts its context: the second call drops the first exchange, so the
capture server seals the first segment and opens a new token-exact one."""

from openai import AsyncOpenAI

from molt_rollout import ChatAgent, ChatContext, ChatRunner, Result


class CompactingAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        first = await client.chat.completions.create(
            model=ctx.model, messages=ctx.messages, max_tokens=6
        )
        summary = f"Earlier you said: {first.choices[0].message.content or ''}"[:40]
        compacted = [{"role": "user", "content": summary}]
        await client.chat.completions.create(model=ctx.model, messages=compacted, max_tokens=6)
        return Result(reward=1.0)


class AgentRunner(ChatRunner):
    agent_class = CompactingAgent
