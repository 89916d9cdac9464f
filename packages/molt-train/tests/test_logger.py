"""The metrics logger's sinks, read back from what they wrote, and the rollout statistics."""

from __future__ import annotations

import glob
import json
import math
import os
import struct
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from molt_capture.tiny_tokenizer import build_tiny_tokenizer
from molt_capture.types import Generation, Rollout, Segment
from molt_train.logger import (
    CONSOLE_COLUMNS,
    LoggerConfig,
    MetricsLogger,
    console_header,
    format_final_message,
    validate_logger_config,
)
from molt_train.metrics import rollout_metrics, sample_rows

STEPS = {
    1: {"rollout/reward_mean": 0.25, "loss/policy": -0.5, "timing/step_total": 3.0},
    2: {"rollout/reward_mean": 0.75, "loss/policy": float("nan"), "eval/pass@1": 0.5},
    3: {"rollout/reward_mean": float("inf"), "is/vllm_kl": 1.5e-4},
}


def log_steps(logger: MetricsLogger) -> None:
    for step, metrics in STEPS.items():
        logger.log(step, metrics)


def test_jsonl_rows_keep_non_finite_values_as_null(tmp_path):
    cfg = LoggerConfig(wandb_mode="disabled", tensorboard=False, console=False)
    logger = MetricsLogger(cfg, str(tmp_path), {})
    log_steps(logger)
    logger.close()
    paths = logger.close()  # a second close is harmless and returns the same paths

    assert paths == {"metrics": str(tmp_path / "metrics.jsonl")}
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row.pop("step") for row in rows] == [1, 2, 3]
    assert all(isinstance(row.pop("time"), float) for row in rows)
    assert rows == [
        STEPS[1],
        {"rollout/reward_mean": 0.75, "loss/policy": None, "eval/pass@1": 0.5},
        {"rollout/reward_mean": None, "is/vllm_kl": 1.5e-4},
    ]


def test_tensorboard_events_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = LoggerConfig(wandb_mode="disabled", jsonl=False, console=False)
    logger = MetricsLogger(cfg, str(tmp_path), {"lr": 1e-6})
    log_steps(logger)
    paths = logger.close()

    assert paths == {"tensorboard": str(tmp_path / "tensorboard")}
    events = EventAccumulator(paths["tensorboard"])
    events.Reload()
    rewards = events.Scalars("rollout/reward_mean")
    assert [e.step for e in rewards] == [1, 2, 3]
    assert [e.value for e in rewards[:2]] == [0.25, 0.75] and math.isinf(rewards[2].value)
    assert [(e.step, e.value) for e in events.Scalars("loss/policy")][0] == (1, -0.5)
    assert math.isnan(events.Scalars("loss/policy")[1].value)
    assert [(e.step, e.value) for e in events.Scalars("eval/pass@1")] == [(2, 0.5)]
    (config,) = events.Tensors("config/text_summary")
    assert config.tensor_proto.string_val[0].decode() == '    {\n      "lr": 1e-06\n    }'


def read_wandb_run(run_folder: str) -> tuple[list[dict], int | None]:
    """History rows and exit code from an offline run's transaction log (`run-<id>.wandb`).

    The file is a 7-byte W&B header, then a LevelDB-style record log in 32 KiB blocks: each
    chunk is crc (4 bytes), length (2), type (1: full, 2: first, 3: middle, 4: last), then
    bytes of one serialized `wandb_internal.Record`.

    `run.finish()` returns before the W&B service has closed the run's stream (that request is
    fire-and-forget), so the file's last records can still be in its buffer; `wandb.teardown()`
    waits for the service to exit, which flushes them (at process exit its atexit hook does this).
    """
    import wandb
    from wandb.proto import wandb_internal_pb2

    wandb.teardown()
    (path,) = glob.glob(os.path.join(run_folder, "*.wandb"))
    data = Path(path).read_bytes()
    block, pos, record, rows, exit_code = 32768, 7, b"", [], None
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room for a header: the block is padding
            pos += block - pos % block
            continue
        _, length, chunk_type = struct.unpack("<IHB", data[pos : pos + 7])
        record += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if chunk_type in (1, 4):
            parsed = wandb_internal_pb2.Record.FromString(record)
            record = b""
            kind = parsed.WhichOneof("record_type")
            if kind == "history":
                rows.append(
                    {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in parsed.history.item
                    }
                )
            elif kind == "exit":
                exit_code = parsed.exit.exit_code
    return rows, exit_code


def test_wandb_offline_run_holds_the_metrics_and_samples(tmp_path):
    cfg = LoggerConfig(tensorboard=False, jsonl=False, console=False, num_sample_rollouts=1)
    logger = MetricsLogger(cfg, str(tmp_path / "run-7"), {"algo": {"lr": 1e-6}})
    log_steps(logger)
    logger.log_samples(3, [{"prompt": "1+1=", "response": "2", "reward": 1.0}, {"prompt": "x"}])
    paths = logger.close()

    assert set(paths) == {"wandb"}
    assert paths["wandb"].startswith(str(tmp_path / "run-7" / "wandb" / "offline-run-"))
    rows, exit_code = read_wandb_run(paths["wandb"])
    assert exit_code == 0
    by_step = {row["_step"]: row for row in rows}
    assert by_step[1]["rollout/reward_mean"] == 0.25 and by_step[1]["loss/policy"] == -0.5
    assert by_step[2]["eval/pass@1"] == 0.5 and by_step[3]["is/vllm_kl"] == 1.5e-4
    # A logged Table is a reference to a file in the run folder (nested keys joined by "/").
    assert by_step[3]["samples/_type"] == "table-file" and by_step[3]["samples/nrows"] == 1
    (table,) = glob.glob(os.path.join(paths["wandb"], "files/media/table/samples_3_*.json"))
    table = json.loads(Path(table).read_text())
    assert table["columns"] == ["prompt", "response", "reward"]
    assert table["data"] == [["1+1=", "2", 1.0]]


def test_wandb_run_that_raised_is_marked_failed(tmp_path):
    cfg = LoggerConfig(tensorboard=False, jsonl=False, console=False)
    logger = MetricsLogger(cfg, str(tmp_path), {})
    logger.log(1, {"rollout/reward_mean": 1.0})
    logger.close(exit_code=1)  # the trainer died
    rows, exit_code = read_wandb_run(logger.close()["wandb"])
    assert exit_code == 1 and rows[0]["rollout/reward_mean"] == 1.0


def test_wandb_disabled_writes_no_wandb_files(tmp_path):
    cfg = LoggerConfig(wandb_mode="disabled", tensorboard=False, console=False)
    logger = MetricsLogger(cfg, str(tmp_path), {})
    log_steps(logger)
    logger.log_samples(3, [{"prompt": "p", "response": "r", "reward": float("nan")}])
    logger.close()
    assert not (tmp_path / "wandb").exists()
    assert set(logger.close()) == {"metrics", "samples"}
    (sample,) = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sample == {"step": 3, "prompt": "p", "response": "r", "reward": None}


def test_console_table(tmp_path, capsys):
    cfg = LoggerConfig(wandb_mode="disabled", tensorboard=False, jsonl=False, console_every=2)
    logger = MetricsLogger(cfg, str(tmp_path), {})
    log_steps(logger)
    logger.log(4, {"timing/generation": 12.345, "perf/train_tokens_per_sec": 98765.4})
    logger.close()
    lines = capsys.readouterr().out.splitlines()

    # The header once, the first step, then every second step.
    assert lines[0] == console_header()
    assert lines[0].split() == ["step"] + [
        h for header, *_ in CONSOLE_COLUMNS for h in header.split()
    ]
    assert [int(line.split()[0]) for line in lines[1:]] == [1, 2, 4]
    assert len({len(line) for line in lines}) == 1  # fixed-width columns
    assert lines[1].split() == ["1", "0.2500", "-", "-0.5"] + ["-"] * 5 + ["3.00", "-", "-"]
    assert lines[2].split() == ["2", "0.7500", "0.500", "-"] + ["-"] * 8  # NaN shows as "-"
    assert lines[3].split() == ["4"] + ["-"] * 5 + ["12.35", "-", "-", "-", "98765", "-"]
    assert "\x1b" not in "".join(lines)


def test_a_resumed_run_drops_the_rows_it_redoes(tmp_path):
    cfg = LoggerConfig(wandb_mode="disabled", tensorboard=False, console=False)
    logger = MetricsLogger(cfg, str(tmp_path), {})
    for step in (1, 2, 3):
        logger.log(step, {"x/y": float(step)})
        logger.log_samples(step, [{"prompt": "p", "response": "r", "reward": 1.0}])
    logger.close()
    # The run crashed after step 3; its latest checkpoint is step 2, so step 3 is redone.
    logger = MetricsLogger(cfg, str(tmp_path), {}, resumed_at=2)
    logger.log(3, {"x/y": 30.0})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["x/y"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    samples = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in samples] == [1, 2]


def test_console_off_prints_nothing(tmp_path, capsys):
    cfg = LoggerConfig(wandb_mode="disabled", tensorboard=False, jsonl=False, console=False)
    logger = MetricsLogger(cfg, str(tmp_path), {})
    log_steps(logger)
    logger.close()
    assert capsys.readouterr().out == ""


def test_a_metric_that_is_not_a_number_is_named(tmp_path):
    cfg = LoggerConfig(wandb_mode="disabled", tensorboard=False, console=False)
    logger = MetricsLogger(cfg, str(tmp_path), {})
    with pytest.raises(TypeError, match="'x/y'"):
        logger.log(1, {"x/y": "high"})


def test_validation(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # none there yet
    with pytest.raises(ValueError, match="--logger.wandb_mode online needs a W&B API key"):
        validate_logger_config(LoggerConfig(wandb_mode="online"))

    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    validate_logger_config(LoggerConfig(wandb_mode="online"))
    monkeypatch.delenv("WANDB_API_KEY")
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    validate_logger_config(LoggerConfig(wandb_mode="online"))  # what `wandb login` writes

    validate_logger_config(LoggerConfig())
    for bad, flag in [
        (LoggerConfig(console_every=0), "--logger.console_every"),
        (LoggerConfig(num_sample_rollouts=-1), "--logger.num_sample_rollouts"),
    ]:
        with pytest.raises(ValueError, match=flag):
            validate_logger_config(bad)


def test_final_message():
    offline = format_final_message(
        {"metrics": "/r/metrics.jsonl", "tensorboard": "/r/tensorboard", "wandb": "/r/wandb/w1"},
        "/r/checkpoints",
    )
    assert offline.splitlines() == [
        "Run outputs:",
        "  metrics (JSONL):  /r/metrics.jsonl",
        "  TensorBoard:      tensorboard --logdir /r/tensorboard",
        "  W&B (offline):    /r/wandb/w1",
        "                    upload with: wandb sync /r/wandb/w1",
        "  checkpoints:      /r/checkpoints",
    ]
    online = format_final_message({"wandb": "/r/wandb/w1", "wandb_url": "https://wandb.ai/x"}, None)
    assert "  W&B:              https://wandb.ai/x" in online and "wandb sync" not in online
    assert online.endswith("  checkpoints:      none saved")


# --- rollout statistics -----------------------------------------------------------------------


def segment(*parts: tuple[str, int, str] | tuple[str, int], truncated: bool = False) -> Segment:
    """Parts ("ctx", n) of context tokens and ("gen", n, finish_reason) of generated ones."""
    seg = Segment(truncated=truncated)
    for part in parts:
        if part[0] == "ctx":
            seg.append_context(list(range(10, 10 + part[1])))
        else:
            n = part[1]
            seg.append_generation(Generation([7] * n, [-0.1] * n, part[2], [2] * n), 16)
    return seg


def hand_computed_batch() -> list[Rollout]:
    return [
        Rollout(
            [segment(("ctx", 3), ("gen", 4, "stop"))],
            reward=1.0,
            rollout_id="r1",
            group_id="a",
            info={"tool_calls": 2, "solved": True},
            timings={"total": 2.0},
        ),
        Rollout(
            [segment(("ctx", 3), ("gen", 2, "stop"), ("ctx", 2), ("gen", 5, "length"))],
            reward=0.0,
            rollout_id="r2",
            group_id="a",
            score=0.5,
            info={"tool_calls": 4, "note": "not a number"},
            timings={"total": 4.0},
        ),
        Rollout(
            [segment(("ctx", 4), ("gen", 2, "stop")), segment(("ctx", 6), ("gen", 3, "stop"))],
            reward=1.0,
            rollout_id="r3",
            group_id="b",
        ),
        Rollout(
            [segment(("ctx", 2), ("gen", 6, "stop"), truncated=True)],
            reward=1.0,
            rollout_id="r4",
            group_id="b",
        ),
        Rollout(
            [segment(("ctx", 5), ("gen", 1, "stop"))], reward=0.5, rollout_id="r5", group_id="c"
        ),
    ]


def test_rollout_metrics_on_a_hand_computed_batch():
    metrics = rollout_metrics(hand_computed_batch())
    # Rewards 1, 0 | 1, 1 | 0.5: group stds 0.5, 0, 0; population std of all five is 0.4.
    assert metrics == pytest.approx(
        {
            "rollout/count": 5.0,
            "rollout/groups": 3.0,
            "rollout/reward_mean": 0.7,
            "rollout/reward_std": 0.4,
            "rollout/group_reward_std_mean": 0.5 / 3,
            "rollout/zero_std_groups": 2 / 3,
            "rollout/score_mean": (1.0 + 0.5 + 1.0 + 1.0 + 0.5) / 5,
            "rollout/response_length_mean": (4 + 7 + 5 + 6 + 1) / 5,
            "rollout/response_length_max": 7.0,
            "rollout/prompt_length_mean": (3 + 3 + 4 + 2 + 5) / 5,
            "rollout/truncated_rate": 2 / 5,  # r2 ends on a length cut, r4 filled its context
            "rollout/turns_mean": (1 + 2 + 2 + 1 + 1) / 5,
            "rollout/segments_mean": (1 + 1 + 2 + 1 + 1) / 5,
            "rollout/info/tool_calls": 3.0,  # over the rollouts that report it
            "rollout/info/solved": 1.0,
            "rollout/time/total": 3.0,
        }
    )


def test_rollout_metrics_of_an_all_dropped_batch():
    assert rollout_metrics([]) == {}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return PreTrainedTokenizerFast.from_pretrained(
        build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    )


def test_sample_rows_decode_one_rollout_per_group_first(tokenizer):
    def rollout(rid: str, group: str, prompt: str, answer: str, version: int, **kw) -> Rollout:
        seg = Segment()
        seg.append_context(tokenizer.encode(prompt))
        ids = tokenizer.encode(answer)
        seg.append_generation(Generation(ids, [0.0] * len(ids), "stop", [version] * len(ids)), 8)
        return Rollout([seg], rollout_id=rid, group_id=group, **kw)

    rollouts = [
        rollout("a1", "a", "What is 2+2?", "4", version=5, reward=1.0),
        rollout("a2", "a", "What is 2+2?", "5", version=4, reward=0.0, score=0.25),
        rollout("b1", "b", "Name a colour.", "red", version=3, reward=1.0),
    ]
    rows = sample_rows(rollouts, tokenizer, k=2, current_version=6)
    assert rows == [
        {"prompt": "What is 2+2?", "response": "4", "reward": 1.0, "version_lag": 1},
        {"prompt": "Name a colour.", "response": "red", "reward": 1.0, "version_lag": 3},
    ]
    rows = sample_rows(rollouts, tokenizer, k=10)
    assert [row["response"] for row in rows] == ["4", "red", "5"]
    assert rows[2]["score"] == 0.25 and "version_lag" not in rows[2]


def test_a_missing_logging_package_is_named_at_start_up(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ValueError, match="--logger.wandb_mode needs the wandb package.*disabled"):
        validate_logger_config(LoggerConfig())
    validate_logger_config(LoggerConfig(wandb_mode="disabled"))
