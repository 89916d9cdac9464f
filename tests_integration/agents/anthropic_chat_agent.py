"""ChatAgent on the stock Anthropic SDK (from `ctx.anthropic_client()`, on the runner's shared
connections): a Messages call with a tool offered, then a streaming call whose history holds
that reply and a tool result."""

from molt_rollout import ChatAgent, ChatContext, ChatRunner, Result

ADD = {"name": "add", "description": "Add two integers.",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer"},
                                                         "b": {"type": "integer"}}}}  # fmt: skip


class MessagesAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = ctx.anthropic_client(max_retries=0)
        args = ctx.anthropic_args()
        args["max_tokens"] = 8
        first = await client.messages.create(model=ctx.model, tools=[ADD], **args)
        text = "".join(block.text for block in first.content if block.type == "text")
        # The random model never calls the tool: the agent writes the call into the history,
        # as a tool loop would after a real tool_use block.
        args["messages"] = [
            *args["messages"],
            {"role": "assistant", "content": [
                *([{"type": "text", "text": text}] if text else []),
                {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"}]},
        ]  # fmt: skip
        async with client.messages.stream(model=ctx.model, tools=[ADD], **args) as stream:
            streamed = "".join([chunk async for chunk in stream.text_stream])
            final = await stream.get_final_message()
        assert final.stop_reason in ("end_turn", "max_tokens"), final.stop_reason
        return Result(reward=float(len(text) + len(streamed)))


class AgentRunner(ChatRunner):
    agent_class = MessagesAgent
