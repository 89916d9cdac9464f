"""Prompt data: loading every file type, row checks, column remapping, the mixed and resumable
prompt stream, and one data path (both agent forms see the same prompt tokens for a loaded row)."""

from __future__ import annotations

import asyncio
import collections
import json

import openai
import pytest
from transformers import PreTrainedTokenizerFast

from molt_capture.testing import ADD_TOOL, FakeGenerator
from molt_capture.tiny_tokenizer import build_tiny_tokenizer
from molt_rollout.agents.agent import ChatAgent, Env, Result
from molt_rollout.agents.chat_runner import ChatRunner
from molt_rollout.agents.data import (
    DataConfig,
    PromptSource,
    load_eval_rows,
    load_rows,
    validate_data_config,
)
from molt_rollout.agents.env_runner import EnvRunner
from molt_rollout.config import RolloutConfig

# Tool schema keys out of the wire order, as a dataset might store them.
TOOL = {
    "type": "function",
    "function": {
        "parameters": ADD_TOOL["function"]["parameters"],
        "name": "add",
        "description": "Add two integers.",
    },
}
ROW = {
    "prompt": [
        {"role": "system", "content": "Use the add tool."},
        {"role": "user", "content": "What is 17+25?"},
    ],
    "tools": [TOOL],
    "label": "42",
    "difficulty": 3,
    "meta": {"id": "q-7", "tags": ["arith"]},
}


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def numbered(n, prefix="q"):
    return [{"prompt": f"{prefix}{i}", "label": i} for i in range(n)]


# ---- loading ------------------------------------------------------------------------------


def test_jsonl_rows_are_kept_and_get_a_data_source(tmp_path):
    spec = write_jsonl(tmp_path / "calc.jsonl", [ROW, {"prompt": "Hi", "data_source": "mine"}])
    rows = load_rows(spec)
    assert rows[0] == {**ROW, "data_source": "calc"}  # system turn, tools, extras untouched
    assert rows[1] == {"prompt": "Hi", "data_source": "mine"}


def test_split_named_file_takes_its_directory_name(tmp_path):
    spec = write_jsonl(tmp_path / "gsm8k" / "test.jsonl", numbered(2))
    assert {r["data_source"] for r in load_rows(spec)} == {"gsm8k"}


def test_json_list_and_data_key(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(numbered(3)))
    (tmp_path / "b.json").write_text(json.dumps({"data": numbered(2)}))
    (tmp_path / "c.json").write_text(json.dumps({"rows": numbered(2)}))
    assert [r["label"] for r in load_rows(str(tmp_path / "a.json"))] == [0, 1, 2]
    assert len(load_rows(str(tmp_path / "b.json"))) == 2
    with pytest.raises(ValueError, match="c.json: expected a list of rows"):
        load_rows(str(tmp_path / "c.json"))
    (tmp_path / "d.json").write_text("[{")
    with pytest.raises(ValueError, match="d.json is not valid JSON"):
        load_rows(str(tmp_path / "d.json"))


def test_parquet_with_tools_as_a_json_string(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Free-form JSON schemas do not survive Arrow structs; datasets store them as strings.
    row = {**ROW, "tools": json.dumps(ROW["tools"])}
    pq.write_table(pa.Table.from_pylist([row, row]), tmp_path / "calc.parquet")
    rows = load_rows(str(tmp_path / "calc.parquet"))
    assert rows[0]["tools"] == ROW["tools"] and rows[0]["prompt"] == ROW["prompt"]
    assert rows[0]["meta"] == ROW["meta"] and rows[0]["data_source"] == "calc"


def test_saved_dataset_and_dataset_dict(tmp_path):
    import datasets

    train, test = datasets.Dataset.from_list(numbered(4)), datasets.Dataset.from_list(numbered(2))
    train.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "both"))
    assert len(load_rows(str(tmp_path / "one"))) == 4
    assert len(load_rows(str(tmp_path / "both"), split="test")) == 2
    assert load_rows(str(tmp_path / "both"))[0]["data_source"] == "both"
    with pytest.raises(ValueError, match=r"has splits \['test', 'train'\], not 'dev'"):
        load_rows(str(tmp_path / "both"), split="dev")


def test_missing_hub_id_or_file_is_a_clear_error(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub

    # No network in tests: offline mode fails at once instead of retrying the hub.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="could not load 'nobody/no-such-dataset'.*load_dataset"):
        load_rows("nobody/no-such-dataset")
    with pytest.raises(ValueError, match="data file .*missing.jsonl does not exist"):
        load_rows(str(tmp_path / "missing.jsonl"))


def test_column_remapping(tmp_path):
    spec = write_jsonl(tmp_path / "qa.jsonl", [{"question": "1+1?", "answer": "2"}])
    (row,) = load_rows(spec, prompt_key="question", label_key="answer")
    assert row["prompt"] == "1+1?" and row["label"] == "2" and row["question"] == "1+1?"
    spec = write_jsonl(tmp_path / "q.jsonl", [{"question": "1+1?"}])
    with pytest.raises(ValueError, match="q.jsonl: row 0 has no label column 'answer'"):
        load_rows(spec, prompt_key="question", label_key="answer")


@pytest.mark.parametrize(
    "row, problem",
    [
        ({"question": "x"}, "row 1 has no prompt"),
        ({"prompt": ""}, "row 1: the prompt is an empty string"),
        ({"prompt": 7}, "row 1: the prompt must be a string or a non-empty list"),
        ({"prompt": [{"content": "x"}]}, "row 1: prompt message 0 must be a dict with 'role'"),
        (
            {"prompt": [{"from": "human", "value": "x"}]},
            "row 1: prompt message 0 must be a dict with 'role'",
        ),
        (
            {"prompt": [{"role": "human", "content": "x"}]},
            "row 1: prompt message 0 has role 'human'",
        ),
        ({"prompt": "x", "tools": {"name": "add"}}, "row 1: tools must be a list"),
        ({"prompt": "x", "tools": [{"name": "add"}]}, "row 1: tool 0 must be"),
        ({"prompt": "x", "tools": "[oops"}, "row 1: tools is a string but not valid JSON"),
        ("just a string", "row 1 is a str, not a dict"),
    ],
)
def test_bad_rows_name_file_row_and_problem(tmp_path, row, problem):
    spec = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(ValueError, match="bad.jsonl: " + problem.replace("(", r"\(")):
        load_rows(spec)


def test_invalid_json_line(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": \n')
    with pytest.raises(ValueError, match="broken.jsonl: line 3 is not valid JSON"):
        load_rows(str(tmp_path / "broken.jsonl"))


# ---- config -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg, flag",
    [
        (DataConfig(), "--data.train_files is empty"),
        (DataConfig(["a", "b"], train_weights=[1.0]), "--data.train_weights has 1 values for 2"),
        (DataConfig(["a", "b"], train_weights=[1.0, -1.0]), "must be >= 0 with a positive sum"),
        (DataConfig(["a", "b"], train_weights=[0.0, 0.0]), "must be >= 0 with a positive sum"),
        (DataConfig(["a"], max_prompts=0), "--data.max_prompts must be >= 1"),
    ],
)
def test_validate_data_config(cfg, flag):
    with pytest.raises(ValueError, match=flag.replace("[", r"\[")):
        validate_data_config(cfg)
    validate_data_config(DataConfig(["a", "b"], train_weights=[0.0, 2.0]))


def test_from_config_and_eval_rows(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", numbered(10, "a"))
    b = write_jsonl(tmp_path / "b.jsonl", [ROW] * 3)
    source = PromptSource.from_config(DataConfig([a, b], max_prompts=4, shuffle=False))
    prompts = [source.next()[1]["prompt"] for _ in range(7)]  # 4 + 3 rows: one epoch
    assert prompts[:5] == ["a0", "a1", "a2", "a3", ROW["prompt"]] and source.epoch == 0
    assert source.next() == (7, {"prompt": "a0", "label": 0, "data_source": "a"})
    assert source.epoch == 1
    assert len(load_eval_rows(DataConfig([a], eval_files=[a, b]))) == 13
    with pytest.raises(ValueError, match="b.jsonl: row 0 has chat messages as prompt but "):
        PromptSource.from_config(DataConfig([a, b], apply_chat_template=False))


# ---- the prompt stream --------------------------------------------------------------------


def test_every_row_once_per_epoch_reshuffled():
    rows = numbered(20)
    source = PromptSource([rows[:5], rows[5:]], shuffle=True, seed=3)
    draws = [source.next() for _ in range(60)]
    assert [i for i, _ in draws] == list(range(60))
    epochs = [[r["label"] for _, r in draws[e * 20 : (e + 1) * 20]] for e in range(3)]
    assert all(sorted(e) == list(range(20)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(20))
    assert source.epoch == 2
    again = PromptSource([rows[:5], rows[5:]], shuffle=True, seed=3)
    assert [again.next()[1]["label"] for _ in range(20)] == epochs[0]  # seeded
    plain = PromptSource([rows], shuffle=False)
    assert [plain.next()[1]["label"] for _ in range(25)] == [*range(20), *range(5)]


@pytest.mark.parametrize("weights", [None, [0.7, 0.3]])
def test_resume_continues_exactly(weights):
    datasets = [numbered(7, "a"), numbered(11, "b")]
    uninterrupted = PromptSource(datasets, weights, shuffle=True, seed=5)
    expected = [uninterrupted.next() for _ in range(87)][37:]

    first = PromptSource(datasets, weights, shuffle=True, seed=5)
    for _ in range(37):
        first.next()
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    resumed = PromptSource(datasets, weights, shuffle=True, seed=5)
    resumed.load_state_dict(state)
    assert [resumed.next() for _ in range(50)] == expected

    with pytest.raises(ValueError, match="the prompt data changed"):
        PromptSource([numbered(8, "a"), numbered(11, "b")], weights).load_state_dict(state)


def test_weights_mix_datasets():
    source = PromptSource([numbered(50, "a"), numbered(3, "b")], [0.8, 0.2], seed=1)
    counts = collections.Counter(source.next()[1]["prompt"][0] for _ in range(5000))
    assert abs(counts["a"] / 5000 - 0.8) < 0.02
    assert source.epoch == counts["a"] // 50  # each dataset wraps on its own
    unnormalised = PromptSource([numbered(5, "a"), numbered(5, "b")], [3, 1], seed=1)
    counts = collections.Counter(unnormalised.next()[1]["prompt"][0] for _ in range(5000))
    assert abs(counts["a"] / 5000 - 0.75) < 0.03


# ---- one data path ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return PreTrainedTokenizerFast.from_pretrained(
        build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    )


def test_loaded_row_gives_both_forms_identical_prompt_tokens(tmp_path, tokenizer):
    """A row read by load_rows (system turn, tools, label, extra columns) reaches the Env and
    the ChatAgent whole, and both forms send the engine the same prompt tokens."""
    (row,) = load_rows(write_jsonl(tmp_path / "calc.jsonl", [ROW]))
    seen = []

    class Done(Env):
        async def step(self, state):
            seen.append(state.row)
            return Result(0.0)

    class Once(ChatAgent):
        async def run(self, ctx):
            seen.append(ctx.row)
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
            async with client:
                await client.chat.completions.create(
                    model=ctx.model, messages=ctx.messages, tools=ctx.tools
                )
            return Result(0.0)

    class EnvForm(EnvRunner):
        env_class = Done

    class ChatForm(ChatRunner):
        agent_class = Once

    prompts = []
    for runner_class in (EnvForm, ChatForm):
        gen = FakeGenerator(tokenizer, ["x"])
        runner = runner_class(gen, tokenizer, RolloutConfig(generator_timeout_s=10))
        try:
            asyncio.run(runner.run(row, rollout_id="r0", group_id="g0"))
        finally:
            runner.close()
        prompts.append(gen.calls[0].token_ids)
    assert prompts[0] == prompts[1]
    text = tokenizer.decode(prompts[0])
    assert "Use the add tool." in text and '"description": "Add two integers."' in text
    for got in seen:
        assert got["label"] == "42" and got["data_source"] == "calc"
        assert got["difficulty"] == 3 and got["meta"] == ROW["meta"]
