"""The CLI: dotted flags, --help, fast failures, config files, the generated flags reference,
and every command line and flag the docs name."""

import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from molt_train.cli import QUICKSTART, parse
from molt_train.config import RunConfig
from molt_train.flags_doc import flag_rows, flags_markdown

ROOT = Path(__file__).resolve().parents[3]


def test_dotted_flags_reach_nested_fields():
    cfg = parse(
        [
            "--algo.advantage.estimator",
            "rloo",
            "--actor.optim.lr",
            "3e-4",
            "--fsdp.offload",
            "optimizer",
            "--data.apply_chat_template",
            "False",
            "--train.max_staleness",
            "None",
        ]
    )
    assert cfg.algo.advantage.estimator == "rloo"
    assert cfg.actor.optim.lr == 3e-4
    assert cfg.fsdp.offload == "optimizer"
    assert cfg.data.apply_chat_template is False
    assert cfg.train.max_staleness is None


def _molt_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "molt_train.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_help_lists_every_flag_with_its_default():
    out = _molt_train("--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for flag in (
        "--algo.advantage.estimator",
        "--algo.advantage.is_correction_level",
        "--algo.dynamic_filtering_enable",
        "--actor.optim.lr",
        "--fsdp.tp_size",
        "--vllm.num_engines",
        "--rollout.n_samples_per_prompt",
        "--train.agent_path",
        "--train.force_on_policy",
        "--data.apply_chat_template",
        "--eval.every_steps",
        "--ckpt.keep_last",
        "--logger.wandb_mode",
        "--ref.enable",
        "--critic.num_workers",
    ):
        assert flag in text, flag
    assert "(default: grpo)" in text


def test_bad_flags_fail_fast_without_starting_anything():
    out = _molt_train("--rollout.n_samples_per_prompt", "1")
    assert out.returncode == 2
    assert "--rollout.n_samples_per_prompt" in out.stderr
    out = _molt_train("--vllm.max_restarts", "0")
    assert out.returncode == 2 and "--vllm.max_restarts" in out.stderr
    out = _molt_train("--no.such_flag", "1")
    assert out.returncode != 0 and "no.such_flag" in out.stderr


def test_flags_doc_is_generated_from_the_dataclasses():
    doc = (ROOT / "docs" / "reference" / "flags.md").read_text()
    assert doc == flags_markdown(), "regenerate: python -m molt_train.flags_doc"


def test_every_flag_has_a_meaning():
    from molt_train.sft import SFTConfig

    missing = [row[0] for cfg in (RunConfig, SFTConfig) for row in flag_rows(cfg) if not row[3]]
    assert not missing, f"flags without a meaning (a comment on the field): {missing}"


def test_config_file_then_flags(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        "[actor.optim]\nlr = 3e-4\n[train]\nforce_on_policy = true\nmax_staleness = 3\n"
        "[rollout]\nchat_template_kwargs = { enable_thinking = false }\n"
        "[vllm]\nray_resources = { engine_node = 1 }\n"
    )
    cfg = parse(["--config", str(toml), "--train.max_staleness", "1"])
    assert cfg.actor.optim.lr == 3e-4 and cfg.train.force_on_policy is True
    assert cfg.train.max_staleness == 1  # the command line wins
    assert cfg.rollout.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.vllm.ray_resources == {"engine_node": 1.0}  # a table as a setting's value
    yaml = tmp_path / "run.yaml"
    yaml.write_text("algo:\n  advantage:\n    estimator: rloo\n")
    assert parse(["--config", str(yaml)]).algo.advantage.estimator == "rloo"


@pytest.mark.parametrize(
    "text, message",
    [
        ("[actor]\nlrr = 1\n", "'actor.lrr' is not a setting"),
        ("[actor.optim]\nlr = 'fast'\n", "--actor.optim.lr"),
        ("actor = 3\n", "'actor' is a group"),
        ("[actor\n", "cannot be read"),
    ],
)
def test_bad_config_files_name_the_key(tmp_path, capsys, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SystemExit):
        parse(["--config", str(path)])
    assert message in capsys.readouterr().err


def test_resolved_config_json_loads_back(tmp_path):
    """A run directory's config.json (written with dataclasses.asdict) reproduces the config."""
    cfg = parse(
        [
            *QUICKSTART,
            "--rollout.chat_template_kwargs",
            "enable_thinking",
            "False",
            "--data.train_weights",
            "1.0",
            "--actor.model_path",
            "/models/x",
        ]
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    assert parse(["--config", str(path)]) == cfg


def test_every_command_line_in_the_docs_parses():
    """Each `molt-train ...` command in a docs code block is accepted by the CLI as written."""
    commands = []
    for page in [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]:
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("#")[0].strip()
                if line.startswith("molt-train ") or line == "molt-train":
                    commands.append((page.name, shlex.split(line)[1:]))
    assert commands
    for page, argv in commands:
        if argv and argv[0] == "sft":
            continue
        argv = QUICKSTART + argv[1:] if argv and argv[0] == "quickstart" else argv
        argv = [a for a in argv if a not in ("--help", "-h")]
        try:
            parse(argv)
        except SystemExit as error:
            raise AssertionError(f"{page}: molt-train {shlex.join(argv)}") from error


def test_docs_name_only_flags_that_exist():
    """A dotted flag named anywhere in the docs is a real one (or the prefix of one, as in
    `--algo.advantage.is_correction_*`): the docs cannot advertise a flag that does not exist."""
    from molt_train.sft import SFTConfig

    flags = {row[0] for row in flag_rows(RunConfig) + flag_rows(SFTConfig)}
    unknown = []
    for page in [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]:
        for mention in re.findall(r"--[a-z_]+\.[a-z_.]*[a-z_]", page.read_text()):
            if not any(flag == mention or flag.startswith(mention) for flag in flags):
                unknown.append(f"{page.name}: {mention}")
    assert not unknown, unknown
