"""One metrics logger feeding every sink: metrics.jsonl and samples.jsonl in the run directory
(non-finite values as null), tensorboard/, wandb/ (an offline run uploads later with `wandb
sync`) and the console. docs/reference/metrics.md lists every metric."""

from __future__ import annotations

import importlib.util
import json
import math
import netrc
import os
import time
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlparse

# The console table: (header, metric key, width, format). The one place to change what it shows.
CONSOLE_COLUMNS = (
    ("reward", "rollout/reward_mean", 8, ".4f"),
    ("pass@1", "eval/pass@1", 7, ".3f"),
    ("loss", "loss/policy", 10, ".4g"),
    ("kl", "is/vllm_kl", 9, ".2e"),
    ("lag", "pool/version_lag_mean", 5, ".2f"),
    ("gen s", "timing/generation", 7, ".2f"),
    ("train s", "timing/policy_train", 7, ".2f"),
    ("refit s", "timing/broadcast", 7, ".2f"),
    ("step s", "timing/step_total", 7, ".2f"),
    ("tok/s", "perf/train_tokens_per_sec", 8, ".0f"),
    ("eta s", "timing/eta_s", 7, ".0f"),
)
STEP_WIDTH = 6


@dataclass
class LoggerConfig:
    """Where metrics go (`--logger.*`)."""

    wandb_mode: Literal["offline", "online", "disabled"] = "offline"  # online needs an API key
    wandb_project: str = "molt"  # the W&B project runs are logged under
    run_name: str | None = None  # the run directory's and W&B run's name; default: a timestamp
    tensorboard: bool = True  # TensorBoard event files in the run directory
    jsonl: bool = True  # metrics.jsonl in the run directory
    console: bool = True  # compact per-step table on stdout
    console_every: int = 1  # print a table line every N steps (and the first step)
    num_sample_rollouts: int = 4  # decoded rollouts per step: W&B table and samples.jsonl


def validate_logger_config(cfg: LoggerConfig) -> None:
    for flag, on, module, off in (
        ("--logger.wandb_mode", cfg.wandb_mode != "disabled", "wandb", "disabled"),
        ("--logger.tensorboard", cfg.tensorboard, "tensorboard", "False"),
    ):
        if on and importlib.util.find_spec(module) is None:
            raise ValueError(f"{flag} needs the {module} package: pip install it, or {flag} {off}")
    if cfg.wandb_mode == "online" and not has_wandb_credentials():
        raise ValueError(
            "--logger.wandb_mode online needs a W&B API key: set WANDB_API_KEY or run `wandb "
            "login`, or use --logger.wandb_mode offline and upload later with `wandb sync`"
        )
    if cfg.console_every < 1 or cfg.num_sample_rollouts < 0:
        raise ValueError("--logger.console_every must be >= 1, --logger.num_sample_rollouts >= 0")


def has_wandb_credentials() -> bool:
    """WANDB_API_KEY, or the .netrc entry `wandb login` writes for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        path = os.environ.get("NETRC", os.path.expanduser("~/.netrc"))
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class MetricsLogger:
    """Every enabled sink behind one `log` call. `resumed_at`: the step a resumed run continues
    from; the JSONL files lose the rows of later steps, which it redoes."""

    def __init__(
        self, cfg: LoggerConfig, run_dir: str, config: dict[str, Any], resumed_at: int | None = None
    ):
        self.cfg, self.run_dir = cfg, os.path.abspath(run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        self.paths: dict[str, str] = {}
        self._console_lines = 0
        if cfg.jsonl:
            self.paths["metrics"] = os.path.join(self.run_dir, "metrics.jsonl")
            if resumed_at is not None:
                for name in ("metrics.jsonl", "samples.jsonl"):
                    _drop_steps_after(os.path.join(self.run_dir, name), resumed_at)
        self._tensorboard = self._wandb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # only when enabled

            self.paths["tensorboard"] = os.path.join(self.run_dir, "tensorboard")
            # flush_secs: a live TensorBoard trails the run by at most this.
            self._tensorboard = SummaryWriter(self.paths["tensorboard"], flush_secs=10)
            lines = json.dumps(config, indent=2, default=str).splitlines()
            # Indented four spaces: TensorBoard renders text as Markdown, this as a code block.
            self._tensorboard.add_text("config", "\n".join("    " + s for s in lines), 0)
        if cfg.wandb_mode != "disabled":
            import wandb  # only when enabled: importing it costs about a second

            self._wandb = wandb.init(
                project=cfg.wandb_project,
                name=cfg.run_name or os.path.basename(self.run_dir),
                dir=self.run_dir,  # W&B makes its own `wandb/` folder in here
                mode=cfg.wandb_mode,
                config=config,
                reinit="create_new",  # our own run object; never touch a caller's global run
            )
            # The run's own folder (…/wandb/offline-run-<time>-<id>), which `wandb sync` takes.
            self.paths["wandb"] = os.path.dirname(self._wandb.dir)
            if cfg.wandb_mode == "online":
                self.paths["wandb_url"] = self._wandb.url

    def log(self, step: int, metrics: dict[str, float]) -> None:
        values = {}
        for key, value in metrics.items():
            try:  # also Python ints and bools, numpy and 0-d torch scalars
                values[key] = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"metric {key!r} is not a number: {value!r}") from None
        if self.cfg.jsonl:
            _append_jsonl(self.paths["metrics"], [{"step": step, "time": time.time(), **values}])
        if self._tensorboard is not None:
            for key, value in values.items():
                self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        if self.cfg.console and (self._console_lines == 0 or step % self.cfg.console_every == 0):
            if self._console_lines == 0:
                print(console_header(), flush=True)
            print(console_line(step, values), flush=True)
            self._console_lines += 1

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Decoded rollouts (keys prompt, response, reward, optional score, version_lag)."""
        samples = samples[: self.cfg.num_sample_rollouts]
        if samples and self.cfg.jsonl:
            self.paths["samples"] = os.path.join(self.run_dir, "samples.jsonl")
            _append_jsonl(self.paths["samples"], [{"step": step, **sample} for sample in samples])
        if samples and self._wandb is not None:
            import wandb

            columns = list(dict.fromkeys(key for sample in samples for key in sample))
            rows = [[sample.get(column) for column in columns] for sample in samples]
            self._wandb.log({"samples": wandb.Table(columns, rows)}, step=step)

    def close(self, exit_code: int = 0) -> dict[str, str]:
        """Flush and finish every sink (once); return {sink: path} (and `wandb_url` when online)."""
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=exit_code)
        self._tensorboard = self._wandb = None
        return dict(self.paths)


def console_header() -> str:
    return " ".join([f"{'step':>{STEP_WIDTH}}"] + [f"{h:>{w}}" for h, _, w, _ in CONSOLE_COLUMNS])


def console_line(step: int, metrics: dict[str, float]) -> str:
    """One fixed-width table row; a missing or NaN metric prints as '-'."""
    cells = [f"{step:>{STEP_WIDTH}}"]
    for _, key, width, fmt in CONSOLE_COLUMNS:
        value = metrics.get(key)
        text = "-" if value is None or math.isnan(value) else format(value, fmt)
        cells.append(f"{text:>{width}}")
    return " ".join(cells)


def format_final_message(paths: dict[str, str], checkpoint_dir: str | None) -> str:
    """Where the run's logs, TensorBoard files, W&B run and checkpoints are."""
    offline = None if "wandb_url" in paths else paths.get("wandb")
    shown = (
        ("metrics (JSONL):  ", paths.get("metrics")),
        ("samples (JSONL):  ", paths.get("samples")),
        ("TensorBoard:      tensorboard --logdir ", paths.get("tensorboard")),
        ("W&B:              ", paths.get("wandb_url")),
        ("W&B (offline):    ", offline),
        ("                  upload with: wandb sync ", offline),
        ("checkpoints:      ", checkpoint_dir or "none saved"),
    )
    return "\n".join(["Run outputs:"] + [f"  {name}{path}" for name, path in shown if path])


def _drop_steps_after(path: str, step: int) -> None:
    """Keep the rows of steps up to `step` (written to a new file, then renamed over)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def _append_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    """Append and close at once (on disk for `tail -f`, through a crash); NaN and Infinity,
    which JSON lacks, as null."""
    with open(path, "a", encoding="utf-8") as f:
        for row in rows:
            clean = {
                k: None if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in row.items()
            }
            f.write(json.dumps(clean) + "\n")
