"""Agents whose tools come from an MCP server, trained through Molt's capture server unmodified.

Two ChatAgents solve the same unit-conversion word problems with the tools of
`molt_examples/mcp_server.py` (a calculator and a unit converter), served over stdio:

- `AgentRunner`: an openai-agents SDK `Agent` with `mcp_servers=[MCPServerStdio(...)]`, its model
  an `OpenAIChatCompletionsModel` on an `AsyncOpenAI` at `ctx.base_url` (`Runner.run` drives the
  tool loop);
- `AnthropicAgentRunner`: an `AsyncAnthropic` at `ctx.anthropic_base_url`, the MCP server's tools
  listed with the `mcp` SDK's `Client` and passed as Anthropic tools (our loop drives it).

To train the Anthropic one, point `--train.agent_path` at a file holding one line:
`from molt_examples.mcp_agent import AnthropicAgentRunner as AgentRunner`.

Reward: 1.0 when the reply's last `Answer: <number>` matches the label, else 0.0.
Data: `python -m molt_examples.mcp_agent OUT.jsonl [ROWS]` writes problems whose labels come from
the server's own functions; data/mcp_units.jsonl is its first 20 rows.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import sys
from pathlib import Path

from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from agents.mcp import MCPServerStdio
from mcp import Client, StdioServerParameters
from mcp.shared.exceptions import MCPError

from molt_examples.mcp_server import convert, number_text
from molt_rollout import ChatAgent, ChatContext, ChatRunner, Result

# The server runs as a script by path: the SDKs start it with a minimal environment (no
# PYTHONPATH), and it needs only the `mcp` package.
SERVER = {"command": sys.executable, "args": [str(Path(__file__).with_name("mcp_server.py"))]}
MAX_TURNS = 6  # model calls per rollout
NO_TRACING = RunConfig(tracing_disabled=True)  # the SDK would otherwise export traces to OpenAI
ANSWER = re.compile(r"Answer:\s*\**\s*(-?[\d,]*\.?\d+)")

# One MCP server process per runner process, shared by all its rollouts: the tools are
# stateless, and starting one costs about 2 s of CPU (a rollout on a small machine costs less).
_servers: dict[tuple, asyncio.Future] = {}
_holders: set[asyncio.Task] = set()


async def connected(make):
    """`make()`'s async context (an MCP client), entered once per event loop by a task of its own
    that keeps it open: a context must be left by the task that entered it, and no rollout lives
    that long. The process's exit stops the server; a failed or lost server is started again."""
    key = (make, id(asyncio.get_running_loop()))
    if key not in _servers:
        _servers[key] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(_hold(key, make()))
        _holders.add(task)
        task.add_done_callback(_holders.discard)
    return await asyncio.shield(_servers[key])


async def _hold(key: tuple, context) -> None:
    ready = _servers[key]
    try:
        async with context as client:
            ready.set_result(client)
            await asyncio.Event().wait()  # forever
    except Exception as e:
        if not ready.done():
            ready.set_exception(e)
    finally:
        _servers.pop(key, None)


def agents_sdk_server() -> MCPServerStdio:
    return MCPServerStdio(SERVER, cache_tools_list=True, name="molt-units")


def mcp_client() -> Client:
    return Client(StdioServerParameters(**SERVER))


def score(text: str, label: str) -> float | None:
    """1.0 if the last `Answer: <number>` is the label (to its 2 decimals), 0.0 if not, None when
    there is no answer."""
    answers = ANSWER.findall(text)
    if not answers:
        return None
    try:
        value = float(answers[-1].replace(",", ""))
    except ValueError:
        return None
    return float(math.isclose(value, float(label), rel_tol=1e-3, abs_tol=0.01))


def scored(text: str, label: str, tool_calls: int, tools: int, truncated=False) -> Result:
    value = score(text, label)
    info = {"tool_calls": tool_calls, "answered": float(value is not None), "mcp_tools": tools}
    return Result(reward=value or 0.0, score=value or 0.0, info=info, truncated=truncated)


class AgentsSDKSolver(ChatAgent):
    """The openai-agents SDK as it is: only its model client points at Molt."""

    async def run(self, ctx: ChatContext) -> Result:
        server = await connected(agents_sdk_server)
        system = [m["content"] for m in ctx.messages if m["role"] == "system"]
        conversation = [m for m in ctx.messages if m["role"] != "system"]
        # ctx.openai_client() is a stock AsyncOpenAI(base_url=ctx.base_url) on shared connections.
        model = OpenAIChatCompletionsModel(model=ctx.model, openai_client=ctx.openai_client())
        agent = Agent(
            name="solver", instructions="\n".join(system) or None, model=model, mcp_servers=[server]
        )
        tools = len(await server.list_tools())
        try:
            result = await Runner.run(
                agent, conversation, max_turns=MAX_TURNS, run_config=NO_TRACING
            )
        except (MaxTurnsExceeded, ModelBehaviorError) as e:  # a policy's mistake scores 0
            items = e.run_data.new_items if e.run_data else []
            calls = sum(item.type == "tool_call_item" for item in items)
            return scored("", ctx.label, calls, tools, truncated=isinstance(e, MaxTurnsExceeded))
        calls = sum(item.type == "tool_call_item" for item in result.new_items)
        return scored(str(result.final_output or ""), ctx.label, calls, tools)


class AnthropicSolver(ChatAgent):
    """The Anthropic SDK with the MCP server's tools, listed and called through the `mcp` SDK."""

    async def run(self, ctx: ChatContext) -> Result:
        mcp = await connected(mcp_client)
        listed = (await mcp.list_tools()).tools
        args = ctx.anthropic_args()  # system, messages, max_tokens
        args["tools"] = [
            {"name": t.name, "description": t.description or "", "input_schema": t.input_schema}
            for t in listed
        ]
        client = ctx.anthropic_client()  # a stock AsyncAnthropic at ctx.anthropic_base_url
        calls = 0
        for _ in range(MAX_TURNS):
            reply = await client.messages.create(model=ctx.model, **args)
            uses = [block for block in reply.content if block.type == "tool_use"]
            if not uses:
                text = "".join(block.text for block in reply.content if block.type == "text")
                return scored(text, ctx.label, calls, len(listed))
            calls += len(uses)
            results = [
                {"type": "tool_result", "tool_use_id": u.id, "content": await call(mcp, u)}
                for u in uses
            ]
            args["messages"] = [
                *args["messages"],
                {"role": "assistant", "content": reply.content},
                {"role": "user", "content": results},
            ]
        return scored("", ctx.label, calls, len(listed), truncated=True)


async def call(mcp: Client, tool_use) -> str:
    """The tool's text; an unknown tool or bad arguments become an error the model reads."""
    try:
        result = await mcp.call_tool(tool_use.name, tool_use.input)
    except MCPError as e:
        return f"error: {e}"
    return "".join(part.text for part in result.content if part.type == "text")


class AgentRunner(ChatRunner):
    agent_class = AgentsSDKSolver


class AnthropicAgentRunner(ChatRunner):
    agent_class = AnthropicSolver


SYSTEM = (
    "Solve the problem. You may call the tools. End your reply with a line "
    "'Answer: <number>', the number rounded to 2 decimals."
)
PROBLEMS = [  # (question, answer from a and k)
    ("A trail is {a} mi long and a hiker walks it {k} times. How many km is that?",
     lambda a, k: convert(a * k, "mi", "km")),
    ("A loaf needs {a} oz of flour. How many g of flour do {k} loaves need?",
     lambda a, k: convert(a * k, "oz", "g")),
    ("A board is {a} ft long. How many m long are {k} boards laid end to end?",
     lambda a, k: convert(a * k, "ft", "m")),
    ("A crate weighs {a} lb. How many kg do {k} crates weigh?",
     lambda a, k: convert(a * k, "lb", "kg")),
    ("An episode runs {a} min. How many h do {k} episodes run?",
     lambda a, k: convert(a * k, "min", "h")),
    ("A room at {a} F warms by {k} degrees C. What is its temperature in C?",
     lambda a, k: convert(a, "F", "C") + k),
]  # fmt: skip


def make_rows(n: int, seed: int = 0) -> list[dict]:
    """`n` problems; each label is the server's own conversion, rounded to 2 decimals."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        question, answer = rng.choice(PROBLEMS)
        a, k = round(rng.uniform(1.5, 80.0), 1), rng.randint(2, 12)
        prompt = [{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": question.format(a=a, k=k)}]  # fmt: skip
        rows.append({"prompt": prompt, "label": number_text(round(answer(a, k), 2)),
                     "data_source": "mcp_units"})  # fmt: skip
    return rows


if __name__ == "__main__":
    out, count = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    Path(out).write_text("".join(json.dumps(row) + "\n" for row in make_rows(count)))
