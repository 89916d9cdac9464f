"""Resumable checkpoints of a run, each actor rank's sharded part of them, and Hugging Face
export of the policy.

Layout under the checkpoint root:

    step_00000100/              one complete checkpoint
      policy/                   ModelGroup.save: sharded DCP (model, optimizer) + rank_*.pt
      critic/ reference/ ...    one directory per actor group that was passed in
      driver_state.json         the loop's own state (step, data position, KL controller, ...)
    step_00000200.tmp/          a save in progress, or one a crash interrupted: never loaded
    best_00000100/              --ckpt.best_metric: hard links to the best step's files
    best -> best_00000100       swapped atomically when a later eval scores better

A save writes everything into `step_N.tmp/`, flushes it to disk, then renames it to `step_N/`
(a rename within one directory is atomic on POSIX file systems): a crash mid-save leaves the
previous checkpoint as the latest, and the next save deletes the stale `.tmp`. With several
nodes the root must be a shared file system: every rank writes its own shards.
"""

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
BEST_LINK = "best"  # symlink to the best_N/ copy of the checkpoint the eval metric chose
BEST_RECORD = "best.json"  # in best_N/: metric, mode, value, weight version
SHARD_BYTES = 5 << 30  # safetensors shard size of an HF export


class CheckpointManager:
    def __init__(self, root: str, keep_last: int) -> None:
        """`keep_last` >= 1 (--ckpt.keep_last, checked at start-up)."""
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, step: int, actors: dict, driver_state: dict) -> str:
        """Checkpoint every actor group (role -> ModelGroup) and the driver's state at `step`;
        return the checkpoint's path."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob("step_*.tmp"):
            shutil.rmtree(stale)
        final = self.root / f"step_{step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        tmp.mkdir()
        for role, group in actors.items():
            group.save(str(tmp / role))
        with open(tmp / DRIVER_STATE, "w") as f:
            json.dump(driver_state, f, indent=2)
        _fsync_tree(tmp)
        if final.exists():  # the same step saved again (a resumed run): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self._prune()
        return str(final)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if STEP_DIR.match(p.name) and p.is_dir()]
        return sorted(found, key=lambda p: p.name)

    def latest(self) -> str | None:
        found = self.checkpoints()
        return str(found[-1]) if found else None

    def load(self, path: str, actors: dict) -> dict:
        """Restore every actor group from checkpoint `path`; return its driver state."""
        for role, group in actors.items():
            group.load(str(Path(path) / role))
        return self.load_driver_state(path)

    @staticmethod
    def load_driver_state(path: str) -> dict:
        with open(Path(path) / DRIVER_STATE) as f:
            return json.load(f)

    @staticmethod
    def export_hf(actor, path: str) -> str:
        """The actor group's current weights as a Hugging Face checkpoint at `path`."""
        actor.export_hf(path)
        return path

    def _prune(self) -> None:
        for old in self.checkpoints()[: -self.keep_last]:
            shutil.rmtree(old)

    def checkpoint_of(self, step: int) -> Path | None:
        """The complete checkpoint of `step` (weight version `step`), if it is still kept."""
        path = self.root / f"step_{step:08d}"
        return path if path.is_dir() else None

    def promote_best(self, step: int, record: dict) -> str:
        """Make checkpoint `step` the run's best: a hard-linked copy `best_N/` (it outlives
        the pruning of `step_N/` and costs no space), then the symlink `best` swapped onto it
        by an atomic rename, then older `best_*` removed. `record` (metric, value, version)
        goes into its best.json. A crash leaves `best` on the old or the new copy, never on a
        partial one."""
        source = self.checkpoint_of(step)
        if source is None:
            raise FileNotFoundError(f"no checkpoint of step {step} under {self.root} to promote")
        final = self.root / f"best_{step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        for stale in (tmp, final):
            if stale.exists():
                shutil.rmtree(stale)
        shutil.copytree(source, tmp, copy_function=os.link)
        with open(tmp / BEST_RECORD, "w") as f:
            json.dump(record, f, indent=2)
        _fsync_tree(tmp)
        os.rename(tmp, final)
        link = self.root / BEST_LINK
        tmp_link = self.root / (BEST_LINK + ".tmp")
        if tmp_link.is_symlink() or tmp_link.exists():
            tmp_link.unlink()
        tmp_link.symlink_to(final.name)
        os.replace(tmp_link, link)
        _fsync_dir(self.root)
        for old in self.root.glob("best_*"):
            if old != final and old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
        return str(final)

    def best(self) -> str | None:
        """The promoted best checkpoint (the target of `best`), if any."""
        link = self.root / BEST_LINK
        return str(link.resolve()) if link.is_symlink() and link.resolve().is_dir() else None


class BestTracker:
    """The best value of one eval metric so far, and the weight version that scored it.

    An eval result is credited to the version whose weights it evaluated, not to the step at
    which it arrives (an asynchronous eval may finish after later refits); `update` says
    whether that version is the new best, and the caller promotes its checkpoint."""

    def __init__(self, metric: str, mode: str = "max") -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"best mode must be 'max' or 'min', got {mode!r}")
        self.metric, self.mode = metric, mode
        self.value: float | None = None
        self.version: int | None = None

    def better(self, value: float) -> bool:
        if value != value:  # NaN never wins
            return False
        if self.value is None:
            return True
        return value > self.value if self.mode == "max" else value < self.value

    def update(self, version: int, metrics: dict[str, float]) -> bool:
        """Credit `metrics` (one eval's results) to weight `version`; True when it is the new
        best (ties keep the earlier version)."""
        value = metrics.get(self.metric)
        if value is None or not self.better(float(value)):
            return False
        self.value, self.version = float(value), version
        return True

    def record(self) -> dict:
        return {"metric": self.metric, "mode": self.mode, "value": self.value,
                "version": self.version}  # fmt: skip

    def state_dict(self) -> dict:
        return {"value": self.value, "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.version = state.get("value"), state.get("version")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file the workers wrote, then the directories naming them."""
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(directory))


def save_sharded(path: str, model, optimizer, rank: int, extra: dict) -> None:
    """One actor rank's part of `ModelGroup.save`: DCP shards of the model (and optimizer,
    through `get_state_dict`, which names Adam's state by parameter), and `extra` (scheduler,
    step count, RNG states) in `rank_<r>.pt`. Collective: every rank calls it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    os.makedirs(path, exist_ok=True)
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
    dcp.save(state, checkpoint_id=path)
    torch.save(extra, os.path.join(path, f"rank_{rank:05d}.pt"))
    dist.barrier()


def load_sharded(path: str, model, optimizer, rank: int) -> dict:
    """Restore what `save_sharded` wrote into `model` (and `optimizer`) in place; return the
    rank's `extra`. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    # Our own file, written by save_sharded: it holds numpy's RNG state, not just tensors.
    return torch.load(os.path.join(path, f"rank_{rank:05d}.pt"), weights_only=False)


def rng_state(cuda_device: torch.device | None) -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if cuda_device is not None:
        state["cuda"] = torch.cuda.get_rng_state(cuda_device)
    return state


def set_rng_state(state: dict, cuda_device: torch.device | None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], cuda_device)


def write_hf_checkpoint(
    path: str, named_tensors: Iterable[tuple[str, torch.Tensor]], config, source: str
) -> None:
    """safetensors shards (+ index when more than one), the model config and the source
    model's tokenizer and generation config: loadable by AutoModelForCausalLM and vLLM.
    Written beside `path` and renamed into place: a crash leaves any earlier export whole."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    final = Path(path)
    out = final.with_name(final.name + ".tmp")
    if out.exists():  # a crashed export's leftovers
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tied = getattr(config, "tie_word_embeddings", False)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in named_tensors:
        if tied and name == "lm_head.weight":  # the embedding holds it
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.cpu().contiguous()
        size += nbytes
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(str(out))
    source_dir = Path(source)
    if (source_dir / "generation_config.json").exists():
        shutil.copy(source_dir / "generation_config.json", out / "generation_config.json")
    AutoTokenizer.from_pretrained(source).save_pretrained(str(out))
    _fsync_tree(out)
    if final.exists():
        shutil.rmtree(final)
    os.rename(out, final)
