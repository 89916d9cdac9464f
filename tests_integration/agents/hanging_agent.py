"""A ChatAgent that hangs forever (and ignores cancellation) when the row says so."""

import asyncio
import time

from openai import AsyncOpenAI

from molt_rollout import ChatAgent, ChatContext, ChatRunner, Result


class HangingAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        await client.chat.completions.create(model=ctx.model, messages=ctx.messages, max_tokens=4)
        if ctx.row.get("hang"):
            while True:  # swallows cancellation: the runner must still return by the deadline
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    time.sleep(0)
        return Result(reward=1.0)


class AgentRunner(ChatRunner):
    agent_class = HangingAgent
