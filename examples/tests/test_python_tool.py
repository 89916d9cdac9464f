"""molt_examples.python_tool: the answer check, the agent's tool loop and its drops against the
capture server (scripted replies), then one `molt-train` run in which the model calls the tool.

A random tiny model never writes a tool call, so the run's model is the tiny model taught first
(a few seconds of plain supervised training, below) to answer each of two GSM8K-format rows with
a `python` call holding the row's own calculation, then to box what the program printed. In the
run the model's calls reach the sandbox through the stock OpenAI SDK, the output comes back as
the tool turn, and every token the trainer gets is checked against the engine's.
"""

import asyncio
import json
import re
from pathlib import Path

import pytest
from recorded import RecordedChat, metrics, molt_train, note_session, read_traces
from transformers import PreTrainedTokenizerFast

from molt_capture.testing import FakeGenerator, assert_token_exact
from molt_capture.testing import tool_call_text as call_text
from molt_capture.tiny_tokenizer import build_tiny_tokenizer
from molt_capture.types import Rollout
from molt_examples import python_tool
from molt_examples.python_tool import PYTHON_TOOL, SYSTEM, as_number, boxed, score
from molt_examples.sandbox import Limits, Sandbox
from molt_rollout import RolloutConfig

EXAMPLES = Path(__file__).resolve().parents[1]
SAMPLE = EXAMPLES / "molt_examples" / "data" / "gsm8k_sample.jsonl"  # GSM8K's format


@pytest.mark.parametrize(
    ("reply", "label", "expected"),
    [
        ("So \\boxed{18}.", "She sells 9 eggs at $2.\n#### 18", (1.0, True)),
        ("\\boxed{1,350} pages", "#### 1350", (1.0, True)),
        ("\\boxed{\\$8.0}", "#### 8", (1.0, True)),
        ("\\boxed{\\frac{3}{4}}", "0.75", (1.0, True)),  # a bare label is the answer
        ("\\boxed{60\\%}", "#### 60", (1.0, True)),
        ("\\boxed{17} or \\boxed{18}", "#### 18", (1.0, True)),  # the last box counts
        ("\\boxed{17}", "#### 18", (0.0, True)),
        ("It is 18.", "#### 18", (0.0, False)),  # no box, no answer
        ("\\boxed{eighteen}", "#### 18", (0.0, True)),
    ],
)
def test_score_reads_the_last_box_as_a_number(reply, label, expected):
    assert score(reply, label) == expected


def test_boxed_keeps_nested_braces():
    assert boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert boxed("\\boxed{unclosed") is None
    assert as_number("1/0") is None


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return PreTrainedTokenizerFast.from_pretrained(
        build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    )


class QuickRunner(python_tool.AgentRunner):
    limits = Limits(timeout_s=2.0, memory_mb=512, max_output_bytes=128)


def scripted(tokenizer, replies: list[str], label: str = "#### 27"):
    """One rollout of the agent against the capture server, the replies scripted."""
    generator = FakeGenerator(tokenizer, replies)
    runner = QuickRunner(generator, tokenizer, RolloutConfig(max_tokens=256, max_len=4096))
    row = {"prompt": [{"role": "user", "content": "Maya has 12 apples..."}], "label": label}
    try:
        return asyncio.run(runner.run(row, "r0", "g0")), generator
    finally:
        runner.close()


def test_the_tools_output_is_the_next_turn_and_the_answer_is_scored(tokenizer):
    code = {"code": "print(12 + 15)"}
    rollout, generator = scripted(tokenizer, [call_text("python", code), "So \\boxed{27}."])
    assert isinstance(rollout, Rollout), rollout
    assert rollout.reward == rollout.score == 1.0
    assert rollout.info["tool_calls"] == 1.0 and rollout.info["tool_errors"] == 0.0
    assert rollout.info["answered"] == 1.0 and rollout.info["turns"] == 2.0
    (segment,) = rollout.segments  # the SDK's echo of the call is the sampled tokens
    assert_token_exact(rollout.segments, generator.calls)
    between = segment.token_ids[segment.turns[0].end : segment.turns[1].start]
    assert "<tool_response>\n27\n\n</tool_response>" in tokenizer.decode(between)
    assert SYSTEM in tokenizer.decode(segment.token_ids[: segment.turns[0].start])


def test_a_bad_call_and_a_long_output_are_the_models_to_read(tokenizer):
    replies = [
        call_text("python", {"source": "print(1)"}),  # no "code"
        call_text("python", {"code": "print('y' * 1000)"}),  # 64 bytes of each end kept
        call_text("python", {"code": "1 / 0"}),  # an exception
        "\\boxed{27}",
    ]
    rollout, generator = scripted(tokenizer, replies)
    assert rollout.info["tool_calls"] == 3.0 and rollout.info["tool_errors"] == 2.0
    assert rollout.reward == 1.0
    prompts = [tokenizer.decode(call.token_ids) for call in generator.calls]
    assert 'call the python tool with {"code"' in prompts[1]
    assert "y" * 64 + "\n[... 873 bytes cut ...]\n" + "y" * 63 + "\n" in prompts[2]
    assert "ZeroDivisionError: division by zero" in prompts[3]  # a traceback's end is kept


def test_the_tool_call_limit_ends_the_rollout_as_truncated(tokenizer):
    rollout, _ = scripted(tokenizer, [call_text("python", {"code": "print(1)"})])
    assert rollout.info["tool_calls"] == QuickRunner.max_tool_calls
    assert rollout.reward == 0.0 and rollout.info["answered"] == 0.0
    assert rollout.segments[-1].truncated


@pytest.mark.parametrize(
    ("code", "reason"),
    [("while True: pass", "tool_timeout"), ("import os; os.abort()", "tool_crashed")],
)
def test_a_runaway_or_crashing_call_drops_the_rollout_with_its_reason(tokenizer, code, reason):
    dropped, _ = scripted(tokenizer, [call_text("python", {"code": code}), "\\boxed{27}"])
    assert not isinstance(dropped, Rollout)
    assert dropped.reason == reason, dropped  # counted as rollout/dropped/<reason>


class RecordedAgent(python_tool.PythonToolAgent):
    async def run(self, ctx):
        note_session(ctx)
        return await super().run(ctx)


class AgentRunner(RecordedChat, python_tool.AgentRunner):
    """The run's agent (this file): the example's runner, every engine call recorded."""

    def make_agent(self):
        return RecordedAgent(self.sandbox, self.max_tool_calls)

    def traced(self, row: dict) -> dict:
        return {"label": row["label"]}


def teach(model, batches: list[dict], steps: int, lr: float = 3e-3) -> float:
    """Plain supervised training of `model` on `batches` (model inputs with `labels`, -100
    where not trained), all of them each step; returns the last step's mean loss. One thread:
    the test machine's cores are few."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    try:
        for _ in range(steps):
            loss = sum(model(**inputs).loss for inputs in batches) / len(batches)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    return loss.item()


def chat_example(render, encode, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """The ids of a conversation as a rollout lays them: each context and each assistant turn
    encoded apart, the turns (to their end-of-turn token) marked as trained."""
    ids, trained, done = [], [], ""
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:k], True)
        reply = render(messages[: k + 1], False)[len(before) :].removesuffix("\n")
        context, turn = encode(before[len(done) :]), encode(reply)
        ids += context + turn
        trained += [False] * len(context) + [True] * len(turn)
        done = before + reply
    return ids, trained


def labels(ids: list[int], trained: list[bool]) -> list[int]:
    return [i if t else -100 for i, t in zip(ids, trained, strict=True)]


def padded_batch(examples: list[tuple[list[int], list[bool]]], pad_id: int) -> dict:
    """One batch of (ids, trained) examples, padded on the right."""
    import torch

    n = max(len(ids) for ids, _ in examples)

    def pad(row: list[int], value: int) -> list[int]:
        return row + [value] * (n - len(row))

    return {
        "input_ids": torch.tensor([pad(ids, pad_id) for ids, _ in examples]),
        "attention_mask": torch.tensor([pad([1] * len(ids), 0) for ids, _ in examples]),
        "labels": torch.tensor([pad(labels(*example), -100) for example in examples]),
    }


def solved(row: dict) -> list[dict]:
    """The conversation taught for a GSM8K row: a python call computing the row's last
    calculator annotation (<<12+15=27>>), its real output, the output boxed."""
    expression = re.findall(r"<<([^=]+)=", row["answer"])[-1]
    code = f"print({expression})"
    output = asyncio.run(Sandbox().run(code)).output
    call = {"type": "function", "function": {"name": "python", "arguments": {"code": code}}}
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": row["question"]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": output},
        {"role": "assistant", "content": f"The answer is \\boxed{{{output.strip()}}}."},
    ]


@pytest.fixture(scope="module")
def taught_model(tmp_path_factory) -> tuple[str, list[dict]]:
    """The tiny model taught the python calls of the sample's first two rows; and those rows."""
    import torch
    from transformers import AutoModelForCausalLM

    from molt_rollout.engines.tiny_model import build_tiny_model

    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:2]]
    path = build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen3")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))

    def render(messages, generation_prompt):
        options = {"tools": [PYTHON_TOOL], "add_generation_prompt": generation_prompt}
        return tokenizer.apply_chat_template(messages, tokenize=False, **options)

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    examples = [chat_example(render, encode, solved(row)) for row in rows]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    loss = teach(model, [padded_batch(examples, tokenizer.pad_token_id)], steps=120)
    assert loss < 0.01, loss
    taught = path.parent / "taught"
    model.save_pretrained(str(taught))
    tokenizer.save_pretrained(str(taught))
    return str(taught), rows


@pytest.mark.slow
def test_molt_train_runs_the_python_tool_agent(tmp_path, taught_model):
    """Two on-policy steps on the taught model: its tool calls run in the sandbox, the output is
    the next turn's masked context, the reward is the example's score of the last reply, and
    every trained token is the engine's (one segment per rollout: the SDK's echo of each call
    is the sampled tokens)."""
    model, rows = taught_model
    data = tmp_path / "gsm8k_sample.jsonl"
    data.write_text("".join(json.dumps(row | {"trace_dir": str(tmp_path)}) + "\n" for row in rows))
    run = tmp_path / "python_tool"
    molt_train(run, "--train.agent_path", __file__, "--actor.model_path", model,
               "--data.train_files", str(data), "--data.eval_files", str(data),
               "--data.prompt_key", "question", "--data.label_key", "answer",
               "--train.num_steps", "2", "--rollout.groups_per_batch", "2",
               "--rollout.n_samples_per_prompt", "2",
               "--rollout.max_tokens", "64", "--rollout.num_runners", "1",
               "--rollout.seed", "0", "--train.force_on_policy", "True",
               "--vllm.dtype", "float32", "--eval.every_steps", "0",
               "--logger.wandb_mode", "disabled", "--ckpt.export_hf", "False")  # fmt: skip
    steps = metrics(run)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert 0.0 <= s["rollout/reward_mean"] <= 1.0
        assert s["rollout/info/tool_calls"] >= 0.0 and 0.0 <= s["rollout/info/answered"] <= 1.0
        assert "rollout/info/tool_errors" in s and "rollout/info/tool_s" in s
    mismatch = [s["is/vllm_kl"] for s in steps if s["is/vllm_kl"] is not None]
    assert mismatch and max(abs(kl) for kl in mismatch) < 1e-3, mismatch
    records = read_traces(tmp_path)
    assert len(records) >= 8  # 2 steps of 2 prompts x 2 samples
    for r in records:
        assert r["dropped"] is None and r["exact"] is True, r
        assert r["trained"] == r["generated"] and r["masked_between"]
        assert r["reward"] == score(r["replies"][-1], r["label"])[0]  # the example's score
    called = [r for r in records if r["info"]["tool_calls"] >= 1]
    assert called, [r["replies"] for r in records]  # the taught model calls the tool
    for r in called:
        assert r["info"]["segments"] == 1.0 and len(r["replies"]) >= 2
        assert "<tool_call>" in r["replies"][0] and '"name": "python"' in r["replies"][0]
        assert "<tool_response>" in r["between"][0]  # the sandbox's output, as context
    outputs = {"27\n", "8.0\n"}  # what the taught programs print
    assert any(f"<tool_response>\n{out}\n</tool_response>" in r["between"][0]
               for r in called for out in outputs)  # fmt: skip
