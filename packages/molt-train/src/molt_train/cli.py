"""The `molt-train` command (RL; `quickstart`: the tiny model learns the shipped task on CPU;
`sft`), its dotted flags generated from the run's dataclasses by tyro (molt_train.flags_doc
writes them out as docs/reference/flags.md). `--config` reads a TOML, YAML or JSON file of the same keys (a run
directory's config.json among them); flags override it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import tomllib
import typing
import warnings
from pathlib import Path

import tyro
import yaml

from molt_rollout.engines.lifeline import end_with_parent
from molt_train.config import RunConfig, StartupError
from molt_train.quickstart import data_path

QUICKSTART = ["--config", str(data_path("settings.toml"))]  # what `molt-train quickstart` adds

OUT_OF_MEMORY = (
    "To fit: lower --actor.max_tokens_per_microbatch, or turn on --actor.gradient_checkpointing "
    "or --fsdp.offload optimizer; beside a colocated engine, also --vllm.enable_sleep_mode or a "
    "lower --vllm.gpu_memory_utilization (docs/operating.md, One GPU)."
)

# Library notices every start printed, none of them the user's to act on: torchao's kernels
# built for other CUDA versions, and torch deprecating the pytree registration of torchao's enums
# (logged); AutoModel's FSDP library falling back from optional fused kernels (a warning).
QUIET = {"torchao": "Failed to load ", "torch.utils._pytree": "is an Enum subclass"}

TYRO_STYLE = dict(use_underscores=True, config=(tyro.conf.FlagConversionOff,))
_BOOL_WORDS = {"true": "True", "false": "False", "True": "True", "False": "False"}
CONFIG_READERS = {".toml": tomllib.loads, ".json": json.loads, ".yaml": yaml.safe_load}
CONFIG_READERS[".yml"] = yaml.safe_load


def command() -> None:
    """The `molt-train` program: `main` in a session of its own, then exit at once (the
    interpreter's exit would only shut Ray down after a sleep and tear down modules)."""
    run_in_own_session()
    main()
    if "ray" in sys.modules:  # a no-op where this process started no Ray
        sys.modules["ray"].shutdown()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def run_in_own_session() -> None:
    """Fork; the child returns, to run the driver in a session of its own: a terminal's Ctrl-C,
    `timeout` and job runners signal a whole process group, Ray's processes too, which the driver
    needs to finish its step and save. The parent passes SIGINT and SIGTERM on (SIGHUP as
    SIGTERM), exits with the child's status; killed, it stops the child (PR_SET_PDEATHSIG)."""
    sys.stdout.flush(), sys.stderr.flush()  # else their buffers would be written twice
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        os.setsid()
        end_with_parent()
        if os.getppid() != parent:  # the parent died before the line above took effect
            os.kill(os.getpid(), signal.SIGTERM)
        return

    def forward(signum: int, frame) -> None:
        with contextlib.suppress(ProcessLookupError):  # it has just ended: waitpid returns
            os.kill(child, signal.SIGTERM if signum == signal.SIGHUP else signum)

    # SIGINT and SIGTERM even where they came in ignored (a shell's background job ignores
    # SIGINT): the driver's own handlers take them. `nohup`'s ignored SIGHUP stays ignored.
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, forward)
    _, status = os.waitpid(child, 0)  # retried after each forwarded signal (PEP 475)
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else ""
    for name, text in QUIET.items():  # before the imports that log them
        logging.getLogger(name).addFilter(lambda record, text=text: text not in record.getMessage())
    warnings.filterwarnings("ignore", "Transformer Engine and Apex are not installed")
    import torch

    from molt_rollout.engines.engine import EngineError
    from molt_train.signals import Stopped

    if command == "sft":
        from molt_train.sft import SFTConfig
        from molt_train.sft import train_sft as train

        cfg = parse(argv[1:], SFTConfig)
    else:  # quickstart: its settings are the defaults `--help` shows
        from molt_train.loop import train

        cfg = parse(argv[1:], default=parse(QUICKSTART)) if command == "quickstart" else parse(argv)
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
        says = str(error).strip().splitlines()[-1].removeprefix("torch.OutOfMemoryError: ")
        message = f"molt-train: a model ran out of GPU memory: {says}\n{OUT_OF_MEMORY}"
        print(message, file=sys.stderr)
        raise SystemExit(1) from None


def parse(argv: list[str], config_type: type = RunConfig, default=None):
    """`--config FILE` and flags -> config, or exit with the CLI's message; `default`: --help's."""
    argv = list(argv)
    while "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            _exit("--config needs a file: TOML, YAML or JSON")
        argv[i : i + 2] = config_file_flags(argv[i + 1], config_type)
    bools = {f"--{name}" for name, kind in _fields(config_type) if kind is bool}
    argv = normalise_bools(argv, bools)
    return tyro.cli(config_type, args=argv, prog="molt-train", default=default, **TYRO_STYLE)


def _exit(message: str) -> typing.NoReturn:
    print(f"molt-train: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _fields(config_type: type, prefix: str = ""):
    """(dotted name, type) of every leaf field, in declaration order."""
    hints = typing.get_type_hints(config_type)
    for f in dataclasses.fields(config_type):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", hints[f.name]


def normalise_bools(argv: list[str], flags: set[str]) -> list[str]:
    """`--x`, `--no-x`, `--x=v` and `--x true|false` -> `--x True|False`, tyro's spelling."""
    out: list[str] = []
    bare = False  # the last word was a flag given without its value: "True" stands in for it
    for arg in argv:
        name, _, value = arg.partition("=")
        if bare and arg in _BOOL_WORDS:
            out[-1] = _BOOL_WORDS[arg]
        elif arg.startswith("--no-") and "--" + arg[5:] in flags:
            out += ["--" + arg[5:], "False"]
        elif name in flags:
            out += [name, _BOOL_WORDS.get(value, value or "True")]
        else:
            out.append(arg)
        bare = arg in flags
    return out


def config_file_flags(path: str, config_type: type = RunConfig) -> list[str]:
    """A TOML/YAML/JSON run config as the flags it stands for (nested tables: dotted groups)."""
    file = Path(path)
    if file.suffix not in CONFIG_READERS:
        _exit(f"--config {path}: use a .toml, .yaml/.yml or .json file")
    try:
        data = CONFIG_READERS[file.suffix](file.read_text()) or {}
    except Exception as error:  # no such file, or a parse error of any of the three formats
        _exit(f"--config {path}: cannot be read: {error}")
    known = dict(_fields(config_type))
    groups = {name.rsplit(".", 1)[0] for name in known if "." in name}
    flags: list[str] = []
    for key, value in _flatten(data, known):
        if key not in known:
            what = "is a group, give its keys" if key in groups else "is not a setting"
            _exit(f"--config {path}: key {key!r} {what} (see docs/reference/flags.md)")
        flags += [f"--{key}", *_as_words(value)]
    return flags


def _flatten(data: typing.Any, known: dict, prefix: str = ""):
    """(flag, value) pairs; a table is a group unless a setting's value (a dict-valued setting)."""
    if not isinstance(data, dict):
        _exit(f"--config: expected a table of settings, got {data!r}")
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and name not in known:
            yield from _flatten(value, known, f"{name}.")
        else:
            yield name, value


def _as_words(value: typing.Any) -> list[str]:
    if isinstance(value, dict):
        return [word for k, v in value.items() for word in (str(k), *_as_words(v))]
    if isinstance(value, list | tuple):
        return [word for v in value for word in _as_words(v)]
    return [str(value)]  # True/False/None print as tyro reads them


if __name__ == "__main__":
    command()
