"""The image task (colours.py) as a ChatAgent: `ctx.messages` hold the row's image as an
OpenAI `image_url` data URL, sent through the stock SDK; the capture server renders it with
the model's processor and records it with the trace."""

from molt_rollout import ChatAgent, ChatContext, ChatRunner, Result
from molt_train.quickstart.colours import colour_reward


class ColourAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = ctx.openai_client()  # the stock AsyncOpenAI at ctx.base_url, built cheaply
        response = await client.chat.completions.create(
            model=ctx.model,
            messages=ctx.messages,
            max_tokens=ctx.max_tokens,
            temperature=ctx.temperature,
        )
        value = colour_reward(response.choices[0].message.content or "", ctx.label)
        return Result(reward=value, score=value)


class AgentRunner(ChatRunner):
    agent_class = ColourAgent
