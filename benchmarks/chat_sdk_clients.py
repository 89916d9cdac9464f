"""The chat quickstart with an SDK client built per rollout against `ctx.openai_client()`.

    RAY_AUTH_MODE=disabled python benchmarks/chat_sdk_clients.py --steps 20 [--rounds 2]

First the cost of one client alone (CPU ms, in this process): `openai.AsyncOpenAI(...)` as an
agent usually builds it, against `ctx.openai_client()` (the same stock class on the event loop's
shared HTTP client). Then, alternating per round, `molt-train quickstart` with the chat form
two ways: the shipped `molt_train.quickstart.halves_chat` (`ctx.openai_client()`) and the same
agent building `openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)` per rollout
(written to a temporary module). Reported as medians over rounds (benchmarks/quickstart_speed.py
measures each run); the ratio is per-rollout / shared.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import openai
from quickstart_speed import PHASES, run_molt

from molt_rollout.agent import ChatContext

PER_ROLLOUT_AGENT = """
import openai

from molt_rollout import ChatAgent, ChatRunner, Result
from molt_train.quickstart.reward import reward


class HalfAgent(ChatAgent):
    async def run(self, ctx):
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
            response = await client.chat.completions.create(
                model=ctx.model, messages=ctx.messages, max_tokens=ctx.max_tokens,
                temperature=ctx.temperature,
            )
        value = reward(response.choices[0].message.content or "", ctx.label)
        return Result(reward=value, score=value)


class AgentRunner(ChatRunner):
    agent_class = HalfAgent
"""


def client_cost_ms(n: int = 50) -> dict[str, float]:
    url = "http://127.0.0.1:1/s/x"  # never dialled: only the clients are built
    ctx = ChatContext(messages=[], tools=None, label=None, row={}, model="m", api_key="k",
                      base_url=url, anthropic_base_url=url, temperature=1.0, top_p=1.0,
                      max_tokens=None, max_len=64)  # fmt: skip

    async def per_client(build) -> float:
        build()  # warm: imports, the shared client
        start = time.process_time()
        for _ in range(n):
            async with build():
                pass
        return (time.process_time() - start) / n * 1e3

    async def both() -> dict[str, float]:
        return {
            "built per rollout": await per_client(
                lambda: openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
            ),
            "ctx.openai_client()": await per_client(ctx.openai_client),
        }

    return asyncio.run(both())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    cost = client_cost_ms()
    print(" | ".join(f"{k}: {v:.3f} CPU ms a client" for k, v in cost.items()))
    out_dir = Path(tempfile.mkdtemp(prefix="chat-sdk-clients-"))
    agent = out_dir / "halves_chat_per_rollout.py"
    agent.write_text(PER_ROLLOUT_AGENT)
    ways = {"per rollout": str(agent), "shared": "molt_train.quickstart.halves_chat"}
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way, path in ways.items():
            runs[way].append(run_molt(args.steps, ["--train.agent_path", path], out_dir))

    def med(way: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[way])

    print(f"{args.steps} steps, {args.rounds} round(s), logs in {out_dir}")
    print("| | client per rollout | ctx.openai_client() | ratio |")
    print("|---|---|---|---|")
    for key in ("median_step_s", "timing/generation", "wall_s", "startup_s"):
        a, b = med("per rollout", key), med("shared", key)
        print(f"| {key} | {a:.3f} | {b:.3f} | {a / b:.2f} |")
    print("\nshared, phases (median over steps 2..N, s): "
          + " | ".join(f"{key} {med('shared', key):.3f}" for key in PHASES))  # fmt: skip


if __name__ == "__main__":
    main()
