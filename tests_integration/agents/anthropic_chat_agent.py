"""ChatAgent on the stock Anthropic SDK: one Messages API call."""

from anthropic import AsyncAnthropic

from molt_rollout import ChatAgent, ChatContext, ChatRunner, Result


class MessagesAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key,
                                max_retries=0)  # fmt: skip
        args = ctx.anthropic_args()
        args["max_tokens"] = 8
        reply = await client.messages.create(model=ctx.model, **args)
        text = "".join(block.text for block in reply.content if block.type == "text")
        return Result(reward=float(len(text)))


class AgentRunner(ChatRunner):
    agent_class = MessagesAgent
