"""Resumable checkpoints of a run, and Hugging Face export.

    step_00000100/            policy/, critic/ (ModelWorker.save: DCP shards + rank_*.pt) and
                              driver_state.json (the loop's step, pool position, KL controller)
    step_00000200.tmp/        a save in progress (renamed when flushed), or one a crash left
    best_00000100/, best ->   --ckpt.best_metric: hard links to the best step's files

Across nodes the root must be a shared file system."""

import dataclasses
import json
import os
import random
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

STEP_DIR = re.compile(r"^step_(\d{8})$")
DRIVER_STATE = "driver_state.json"
SHARD_BYTES = 5 << 30  # safetensors shard size of an HF export


class CheckpointManager:
    def __init__(self, root: str, keep_last: int) -> None:
        self.root, self.keep_last = Path(root), keep_last

    def save(self, step: int, actors: dict, driver_state: dict) -> str:
        """Checkpoint every model group (role -> ModelGroup) and the driver's state at `step`."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob("step_*.tmp"):
            shutil.rmtree(stale)
        final = self.root / f"step_{step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        tmp.mkdir()
        for role, group in actors.items():
            group.save(str(tmp / role))
        (tmp / DRIVER_STATE).write_text(json.dumps(driver_state, indent=2))
        _rename_into_place(tmp, final)  # the same step saved again (a resumed run): replaced
        for old in self.checkpoints()[: -self.keep_last]:
            shutil.rmtree(old)
        return str(final)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        found = self.root.iterdir() if self.root.is_dir() else []
        return sorted(p for p in found if STEP_DIR.match(p.name) and p.is_dir())

    def latest(self) -> str | None:
        found = self.checkpoints()
        return str(found[-1]) if found else None

    def load(self, path: str, actors: dict) -> dict:
        """Restore every model group from checkpoint `path`; return its driver state."""
        for role, group in actors.items():
            group.load(str(Path(path) / role))
        return json.loads((Path(path) / DRIVER_STATE).read_text())

    def promote_best(self, step: int, record: dict) -> str:
        """Checkpoint `step` as `best_N/` (hard links: they outlive `step_N/`, in no space) with
        `record` in best.json; then `best` swapped onto it atomically."""
        source = self.root / f"step_{step:08d}"  # gone: copytree raises FileNotFoundError
        final = self.root / f"best_{step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp, copy_function=os.link)
        (tmp / "best.json").write_text(json.dumps(record, indent=2))
        _rename_into_place(tmp, final)
        link = self.root / "best.tmp"
        link.unlink(missing_ok=True)
        link.symlink_to(final.name)
        os.replace(link, self.root / "best")
        _fsync(self.root)
        for old in self.root.glob("best_*"):
            if old != final and old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
        return str(final)


@dataclasses.dataclass
class BestTracker:
    """The best value of one eval metric so far, credited to the weight version it evaluated."""

    metric: str
    mode: str = "max"  # or "min" (--ckpt.best_mode)
    value: float | None = None
    version: int | None = None

    def update(self, version: int, metrics: dict[str, float]) -> bool:
        """Credit one eval to weight `version`; True when it is the new best (a tie keeps the
        earlier, NaN never wins)."""
        value, best = float(metrics.get(self.metric, "nan")), self.value
        worse = best is not None and (value <= best if self.mode == "max" else value >= best)
        if value != value or worse:
            return False
        self.value, self.version = value, version
        return True

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.value, self.version = state.get("value"), state.get("version")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename_into_place(tmp: Path, final: Path) -> None:
    """Flush every file under `tmp` and the directories naming them, then replace `final`."""
    for directory, _, files in os.walk(tmp):
        for name in files:
            _fsync(Path(directory, name))
        _fsync(Path(directory))
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(final.parent)


def rng_state(device: torch.device) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state()}
    state["torch"] = torch.get_rng_state()
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def write_hf_checkpoint(
    path: str, named_tensors: Iterable[tuple[str, torch.Tensor]], config, source: str
) -> None:
    """safetensors shards, config, the source's tokenizer and generation config, loadable by
    transformers and vLLM; written beside `path` and renamed in (a crash leaves an earlier one)."""
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoTokenizer

    tied = getattr(config, "tie_word_embeddings", False)  # then the embedding holds the LM head
    state = {
        n: t.cpu().contiguous() for n, t in named_tensors if not (tied and n == "lm_head.weight")
    }
    out = Path(path).with_name(Path(path).name + ".tmp")
    shutil.rmtree(out, ignore_errors=True)  # a crashed export's leftovers
    out.mkdir(parents=True)
    # model.safetensors, or shards with their index.
    save_torch_state_dict(state, out, max_shard_size=SHARD_BYTES)
    config.save_pretrained(str(out))
    if (Path(source) / "generation_config.json").exists():
        shutil.copy(Path(source) / "generation_config.json", out / "generation_config.json")
    AutoTokenizer.from_pretrained(source).save_pretrained(str(out))
    _rename_into_place(out, Path(path))
