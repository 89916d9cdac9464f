"""The `molt-train` command: dotted flags generated from the run's dataclasses by tyro.

    molt-train [--actor.* --ref.* --critic.* --fsdp.* --vllm.* --router.* --refit.* --rollout.*
                --train.* --algo.* --data.* --eval.* --ckpt.* --logger.*]
    molt-train quickstart [flags]     the tiny model learns the shipped task on CPU
    molt-train sft [flags]

With no model or data flags a run trains the embedded tiny model on the shipped alphabet-halves
task; `quickstart` adds the settings that learn it in a few minutes.
`python -m molt_train.cli flags-doc` rewrites docs/flags.md from the same dataclasses.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path

import tyro

from molt_train.config import RunConfig, validate_agent, validate_run_config

# `molt-train quickstart`: the shipped alphabet-halves task (the defaults' data and agent) with
# settings that learn it on CPU in a few minutes (benchmarks/quickstart_task_prototype.py).
# Flags given after `quickstart` override these.
QUICKSTART = [
    "--actor.optim.lr", "5e-3",
    # Cosine down to a tenth over the 40 steps: at a constant 5e-3, Adam's momentum on the
    # near-zero gradients of a solved batch pushed one run past the optimum (reward 1.0 at
    # step 25, 0.44 at 26, stuck: every group then scores alike and gives no signal back).
    "--actor.optim.schedule", "cosine",
    "--actor.optim.total_steps", "40",
    "--actor.optim.min_lr", "5e-4",
    "--rollout.max_tokens", "1",
    "--rollout.groups_per_batch", "16",
    "--rollout.n_samples_per_prompt", "8",
    # One-step off-policy: every trained token is at most one version old however fast the
    # machine is (one batch generated ahead lets a slow trainer see two-version-old batches,
    # which learned this task visibly slower on a loaded CI machine).
    "--train.async_queue_size", "0",
    "--train.num_steps", "40",
    "--eval.every_steps", "10",
    "--vllm.dtype", "float32",  # the tiny model is fp32; vLLM's "auto" would downcast it
]  # fmt: skip

_TYRO_STYLE = dict(use_underscores=True, config=(tyro.conf.FlagConversionOff,))


def parse(argv: list[str], config_type: type = RunConfig):
    """Flags -> config (exits with tyro's message on an unknown flag or a bad value)."""
    return tyro.cli(config_type, args=argv, prog="molt-train", **_TYRO_STYLE)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "sft":
        from molt_train.sft import SFTConfig, train_sft, validate_sft_config

        cfg = parse(argv[1:], SFTConfig)
        _fail_fast(validate_sft_config, cfg)
        train_sft(cfg)
        return
    if argv and argv[0] == "quickstart":
        argv = QUICKSTART + argv[1:]
    elif argv and argv[0] == "flags-doc":
        write_flags_doc(argv[1] if len(argv) > 1 else "docs/flags.md")
        return
    cfg = parse(argv)
    _fail_fast(validate_run_config, cfg)  # before Ray or any engine starts
    _fail_fast(validate_agent, cfg)
    from molt_train.loop import train

    train(cfg)


def _fail_fast(validate, cfg) -> None:
    try:
        validate(cfg)
    except ValueError as error:
        print(f"molt-train: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


# ---- docs/flags.md ---------------------------------------------------------------------------


def flag_rows(config_type: type, prefix: str = "", default=None) -> list[tuple[str, str, str, str]]:
    """(flag, type, default, comment) for every leaf field, in declaration order."""
    rows = []
    comments = _field_comments(config_type)
    hints = typing.get_type_hints(config_type)
    default = config_type() if default is None else default
    for f in dataclasses.fields(config_type):
        name = f"{prefix}{f.name}"
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            rows += flag_rows(type(value), f"{name}.", value)
            continue
        type_name = re.sub(r"\b(typing|builtins)\.", "", str(hints[f.name]).replace("<class '", "").replace("'>", ""))  # fmt: skip
        # Shipped files default to paths inside the installed package: show them portably.
        shown = repr(value).replace(str(Path(__file__).parent), "<molt_train>")
        rows.append((f"--{name}", type_name, shown, comments.get(f.name, "")))
    return rows


def _field_comments(config_type: type) -> dict[str, str]:
    """The trailing `# ...` comment of each field line of a dataclass's source."""
    comments = {}
    for cls in reversed(config_type.__mro__[:-1]):
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        for match in re.finditer(r"^\s+(\w+):[^#\n]*#\s*(.+)$", source, re.MULTILINE):
            comments[match.group(1)] = match.group(2).strip()
    return comments


def flags_markdown() -> str:
    from molt_train.sft import SFTConfig

    lines = [
        "# Flags",
        "",
        "Generated from the dataclasses by `python -m molt_train.cli flags-doc`; do not edit.",
        "`molt-train --help` prints the same with the help text of each group.",
        "",
    ]
    for title, config_type in (("molt-train", RunConfig), ("molt-train sft", SFTConfig)):
        lines += [f"## {title}", "", "| flag | type | default | meaning |", "|---|---|---|---|"]
        for flag, type_name, default, comment in flag_rows(config_type):
            cells = (flag, type_name, default, comment)
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def write_flags_doc(path: str) -> None:
    with open(path, "w") as f:
        f.write(flags_markdown())


if __name__ == "__main__":
    main()
