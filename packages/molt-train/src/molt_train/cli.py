"""The `molt-train` command: dotted flags generated from the run's dataclasses by tyro.

    molt-train [--config run.toml] [--actor.* --ref.* --critic.* --fsdp.* --vllm.* --router.*
                --refit.* --rollout.* --train.* --algo.* --data.* --eval.* --ckpt.* --logger.*]
    molt-train quickstart [flags]     the tiny model learns the shipped task on CPU
    molt-train sft [flags]

With no model or data flags a run trains the embedded tiny model on the shipped alphabet-halves
task; `quickstart` adds the settings that learn it in a few minutes (docs/quickstart.md says
how they were chosen). `--config` reads a TOML, YAML or JSON file of the same keys (a run
directory's config.json among them); flags on the command line override it. Booleans take
`--x`, `--no-x` and `--x true|false|True|False`.
`python -m molt_train.cli flags-doc` rewrites docs/flags.md from what tyro reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import typing
import warnings
from pathlib import Path
from typing import Any

import tyro

from molt_train.config import RunConfig, StartupError
from molt_train.own_session import run_in_own_session

# `molt-train quickstart`: the shipped alphabet-halves task (the defaults' data and agent) with
# settings that learn it on CPU in a few minutes. Flags given after `quickstart` override these.
QUICKSTART = [
    "--actor.optim.lr", "5e-3",
    "--actor.optim.schedule", "cosine",
    "--actor.optim.total_steps", "40",
    "--actor.optim.min_lr", "5e-4",
    "--rollout.max_tokens", "1",
    "--rollout.groups_per_batch", "16",
    "--rollout.n_samples_per_prompt", "8",
    "--train.async_queue_size", "0",
    "--train.num_steps", "40",
    "--eval.every_steps", "10",
    "--vllm.dtype", "float32",  # the tiny model is fp32; vLLM's "auto" would downcast it
]  # fmt: skip

_TYRO_STYLE = dict(use_underscores=True, config=(tyro.conf.FlagConversionOff,))
_BOOL_WORDS = {"true": "True", "false": "False", "True": "True", "False": "False"}


def parse(argv: list[str], config_type: type = RunConfig, default=None):
    """`--config FILE` and flags -> config (exits with the CLI's message on an unknown flag, a
    bad value or a bad config file). `default`: the config the flags change (and `--help`
    shows), instead of the dataclass defaults."""
    argv = list(argv)
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            _exit("--config needs a file: TOML, YAML or JSON")
        argv[i : i + 2] = config_file_flags(argv[i + 1], config_type)
    argv = normalise_bools(argv, bool_flags(config_type))
    return tyro.cli(config_type, args=argv, prog="molt-train", default=default, **_TYRO_STYLE)


def command() -> None:
    """The `molt-train` program: `main` in a session of its own (molt_train.own_session says why).
    Python callers run `main` in place."""
    run_in_own_session()
    main()
    exit_now()


def exit_now() -> typing.NoReturn:
    """End the finished command at once. Its files are closed and its servers ended; what the
    interpreter's exit would still do is Ray's atexit shutdown (a 0.5 s sleep first) and the
    teardown of torch's, vLLM's and Ray's modules, about 1.5 s together (docs/benchmarks.md,
    "A run's exit")."""
    if "ray" in sys.modules:
        import ray

        ray.shutdown()  # no-op where this process started no Ray
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "sft":
        from molt_train.sft import SFTConfig, train_sft, validate_sft_config

        cfg = parse(argv[1:], SFTConfig)
        try:
            validate_sft_config(cfg)
        except ValueError as error:
            _exit(str(error))
        train_sft(cfg)
        return
    if argv and argv[0] == "flags-doc":
        write_flags_doc(argv[1] if len(argv) > 1 else "docs/flags.md")
        return
    if argv and argv[0] == "quickstart":  # its settings are the defaults `--help` shows
        cfg = parse(argv[1:], default=parse(QUICKSTART))
    else:
        cfg = parse(argv)
    import torch

    from molt_rollout.engine import EngineError
    from molt_train.loop import train
    from molt_train.signals import Stopped

    try:
        train(cfg)  # validates before Ray or any engine starts
    except StartupError as error:
        _exit(str(error))
    except Stopped as stop:  # SIGTERM / SIGINT: the loop has shut down cleanly
        print(f"molt-train: {stop}", file=sys.stderr)
        raise SystemExit(128 + stop.signum) from None
    except EngineError as error:  # its message names the engine and holds its log tail
        print(f"molt-train: engine failure: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    except torch.OutOfMemoryError as error:  # a worker's, raised through Ray as its own type
        # The last line of the remote traceback Ray carries: torch's sizes.
        torch_says = str(error).strip().splitlines()[-1].removeprefix("torch.OutOfMemoryError: ")
        print(f"molt-train: a model ran out of GPU memory: {torch_says}\n{OUT_OF_MEMORY}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(1) from None


OUT_OF_MEMORY = (
    "To fit: lower --actor.max_tokens_per_microbatch, or turn on --actor.gradient_checkpointing "
    "or --fsdp.offload optimizer; beside a colocated engine, also --vllm.enable_sleep_mode or a "
    "lower --vllm.gpu_memory_utilization (docs/rollout.md, the memory arithmetic)."
)


def _exit(message: str) -> typing.NoReturn:
    print(f"molt-train: error: {message}", file=sys.stderr)
    raise SystemExit(2)


# ---- booleans and config files --------------------------------------------------------------


def _fields(config_type: type, prefix: str = ""):
    """(dotted name, type) of every leaf field, in declaration order."""
    hints = typing.get_type_hints(config_type)
    for f in dataclasses.fields(config_type):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from _fields(kind, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", kind


def bool_flags(config_type: type) -> set[str]:
    return {f"--{name}" for name, kind in _fields(config_type) if kind is bool}


def normalise_bools(argv: list[str], flags: set[str]) -> list[str]:
    """`--x`, `--no-x`, `--x=v` and `--x true|false` -> `--x True|False`, tyro's spelling."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, _, value = arg.partition("=")
        negated = "--" + arg[len("--no-") :] if arg.startswith("--no-") else None
        if negated in flags:
            out += [negated, "False"]
        elif name in flags and value:
            out += [name, _BOOL_WORDS.get(value, value)]
        elif arg in flags:
            following = argv[i + 1] if i + 1 < len(argv) else None
            if following in _BOOL_WORDS:
                out += [arg, _BOOL_WORDS[following]]
                i += 1
            else:
                out += [arg, "True"]
        else:
            out.append(arg)
        i += 1
    return out


def config_file_flags(path: str, config_type: type = RunConfig) -> list[str]:
    """A TOML/YAML/JSON run config as the flags it stands for (so the CLI checks its values
    as it checks flags). Nested tables are the dotted groups; every key must be a flag."""
    file = Path(path)
    if not file.is_file():
        _exit(f"--config {path}: no such file")
    try:
        text = file.read_text()
        if file.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif file.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif file.suffix == ".json":
            data = json.loads(text)
        else:
            _exit(f"--config {path}: use a .toml, .yaml/.yml or .json file")
    except Exception as error:  # a parse error of any of the three formats
        _exit(f"--config {path}: cannot be read: {error}")
    known = dict(_fields(config_type))
    groups = {name.rsplit(".", 1)[0] for name in known if "." in name}
    flags: list[str] = []
    for key, value in _flatten(data, known):
        if key not in known:
            what = "is a group, give its keys" if key in groups else "is not a setting"
            _exit(f"--config {path}: key {key!r} {what} (see docs/flags.md)")
        flags += [f"--{key}", *_as_words(value)]
    return flags


def _flatten(data: Any, known: dict, prefix: str = ""):
    """(flag, value) pairs; a table is a group of settings unless it is a setting's value
    (a dict-valued setting such as --rollout.chat_template_kwargs)."""
    if not isinstance(data, dict):
        _exit(f"--config: expected a table of settings, got {data!r}")
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and name not in known:
            yield from _flatten(value, known, f"{name}.")
        else:
            yield name, value


def _as_words(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [word for k, v in value.items() for word in (str(k), *_as_words(v))]
    if isinstance(value, list | tuple):
        return [word for v in value for word in _as_words(v)]
    return [str(value)]  # True/False/None print as tyro reads them


# ---- docs/flags.md ---------------------------------------------------------------------------


def flag_rows(config_type: type) -> list[tuple[str, str, str, str]]:
    """(flag, type, default, meaning) of every flag, as tyro's own parser has them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        parser = tyro.extras.get_parser(config_type, **_TYRO_STYLE)
    rows = []
    for action in parser._actions:
        if not action.option_strings or action.option_strings[0] == "-h":
            continue
        meaning, _, default = (action.help or "").rpartition("(default: ")
        default = default.removesuffix(")")
        # Shipped files default to paths inside the installed package: show them portably.
        default = default.replace(str(Path(__file__).parent), "<molt_train>")
        rows.append((action.option_strings[0], str(action.metavar), default, meaning.strip()))
    return rows


def flags_markdown() -> str:
    from molt_train.sft import SFTConfig

    lines = [
        "# Flags",
        "",
        "Generated by `python -m molt_train.cli flags-doc` from what the CLI (tyro) reads; do not",
        "edit. `molt-train --help` prints the same. Booleans take `--x`, `--no-x` and",
        "`--x true|false`; `--config FILE` (TOML, YAML, JSON) sets any of them, flags override.",
        "",
    ]
    for title, config_type in (("molt-train", RunConfig), ("molt-train sft", SFTConfig)):
        lines += [f"## {title}", "", "| flag | type | default | meaning |", "|---|---|---|---|"]
        for row in flag_rows(config_type):
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
        lines.append("")
    return "\n".join(lines)


def write_flags_doc(path: str) -> None:
    with open(path, "w") as f:
        f.write(flags_markdown())


if __name__ == "__main__":
    command()
