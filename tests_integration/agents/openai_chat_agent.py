"""ChatAgent on the stock OpenAI SDK: a streaming call with tools, then a second call whose
history holds a tool call and its result."""

import json

from openai import AsyncOpenAI

from molt_rollout import ChatAgent, ChatContext, ChatRunner, Result

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}  # fmt: skip


class ToolAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = list(ctx.messages)
        stream = await client.chat.completions.create(
            model=ctx.model, messages=messages, tools=[ADD], max_tokens=8, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        call = {"id": "call_1", "type": "function",
                "function": {"name": "add", "arguments": json.dumps({"a": 1, "b": 2})}}  # fmt: skip
        messages += [{"role": "assistant", "content": text, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "3"}]  # fmt: skip
        reply = await client.chat.completions.create(
            model=ctx.model, messages=messages, tools=[ADD], max_tokens=8
        )
        return Result(reward=float(len(reply.choices[0].message.content or "")))


class AgentRunner(ChatRunner):
    agent_class = ToolAgent
