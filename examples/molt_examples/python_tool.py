"""Tool-integrated reasoning: the model solves math word problems with a `python` tool, called
through the stock OpenAI SDK. Each call's program runs in a sandbox (molt_examples.sandbox) and
what it prints comes back as the tool's turn; the final answer, in \\boxed{}, is scored against
the dataset's. Every generated token is recorded and trained; the tool's output is context.

Reads GSM8K as downloaded ({"question", "answer": "...#### 42"}) through Molt's column
remapping: --data.prompt_key question --data.label_key answer. A label without "####" is taken
as the answer itself. Run: --train.agent_path molt_examples.python_tool
(docs/environments/python_tool.md).
"""

from __future__ import annotations

import json
import re
from fractions import Fraction

from molt_examples.sandbox import Limits, Sandbox
from molt_rollout import ChatAgent, ChatContext, ChatRunner, Result, RolloutDropped

PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python 3 program and return what it prints (stdout and stderr). "
        "Each call is a fresh process: define everything you use, and print the result.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program"}},
            "required": ["code"],
        },
    },
}
SYSTEM = (
    "Solve the problem. You may run Python with the python tool to compute anything. "
    "Put the final answer in \\boxed{}."
)


def boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text` (braces inside it balanced), else None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i]
    return None


def as_number(text: str) -> Fraction | None:
    """A number as GSM8K writes answers: "1,200", "$18", "7.5", "3/4", "\\frac{3}{4}", "60%"."""
    text = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", text)
    text = re.sub(r"[\s$,%()]|\\[%$!]|\\text\{[^{}]*\}", "", text).rstrip(".")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def score(reply: str, label: str) -> tuple[float, bool]:
    """(reward, whether the reply had a boxed answer): 1 when it equals the label's number."""
    answer = boxed(reply)
    gold = as_number(str(label).rsplit("####", 1)[-1])
    value = as_number(answer) if answer is not None else None
    return float(value is not None and value == gold), answer is not None


class PythonToolAgent(ChatAgent):
    def __init__(self, sandbox: Sandbox, max_tool_calls: int):
        self.sandbox, self.max_tool_calls = sandbox, max_tool_calls
        self.stats = {"tool_calls": 0.0, "tool_errors": 0.0, "tool_s": 0.0}

    async def run(self, ctx: ChatContext) -> Result:
        messages = list(ctx.messages)
        if messages[0]["role"] != "system":  # a dataset's own system turn is kept
            messages.insert(0, {"role": "system", "content": SYSTEM})
        client = ctx.openai_client()  # the stock AsyncOpenAI at the rollout's capture session
        while True:
            response = await client.chat.completions.create(
                model=ctx.model, messages=messages, tools=[PYTHON_TOOL]
            )
            choice = response.choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            calls = choice.message.tool_calls or []
            cut = choice.finish_reason == "length"  # the length budget ended the reply
            if not calls or cut or self.stats["tool_calls"] >= self.max_tool_calls:
                break
            for call in calls:
                output = await self.call(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        reward, answered = score(choice.message.content or "", ctx.label)
        info = self.stats | {"answered": float(answered)}
        return Result(reward=reward, score=reward, info=info, truncated=bool(calls) or cut)

    async def call(self, name: str, arguments: str) -> str:
        """Run one tool call. A mistake in the call is the model's to read; a program that runs
        past its time or dies of a signal drops the rollout (`rollout/dropped/tool_timeout`,
        `tool_crashed`): such a call says nothing about the answer."""
        self.stats["tool_calls"] += 1
        try:
            code = json.loads(arguments)["code"] if name == "python" else None
        except (ValueError, TypeError, KeyError):
            code = None
        if not isinstance(code, str):
            self.stats["tool_errors"] += 1
            return 'error: call the python tool with {"code": "<a Python program>"}'
        execution = await self.sandbox.run(code)
        self.stats["tool_s"] += execution.seconds
        if execution.status in ("timeout", "crashed"):
            detail = f"exit code {execution.exit_code}; output: {execution.output[-300:]!r}"
            raise RolloutDropped(f"tool_{execution.status}", detail)
        self.stats["tool_errors"] += float(execution.status == "error")
        return execution.output or "(no output: print what you want to see)"


class AgentRunner(ChatRunner):
    agent_class = PythonToolAgent
    limits = Limits(timeout_s=10.0, memory_mb=1024, max_output_bytes=2048)
    max_tool_calls = 4  # per rollout; then the reply so far is scored

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sandbox = Sandbox(self.limits)  # one per runner process: the isolation is probed once

    def make_agent(self) -> ChatAgent:
        return PythonToolAgent(self.sandbox, self.max_tool_calls)
