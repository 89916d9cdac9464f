"""Adapter refit (`--actor.lora.refit adapter`): the engines serve the base model plus one LoRA
adapter per weight version, the newest `keep`; no pause: a request names its version's adapter.
A retired version's files become links to one zeroed adapter (docs/concepts/refit.md)."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from molt_rollout.config import RefitConfig, adapter_name
from molt_rollout.refit.control import EngineControl, EngineSet, RefitError

# vLLM's --max-lora-rank choices (vllm.config.lora.MaxLoRARanks, the same in 0.26 and 0.32):
# the engine's rank is the smallest of them that holds the adapter's (zero-padded).
ENGINE_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_ENGINE_LORA_RANK = ENGINE_LORA_RANKS[-1]
ADAPTER_PREFIX = "molt-lora"  # adapter names: molt-lora-v<version>


def engine_lora_rank(rank: int) -> int:
    """vLLM's --max-lora-rank for adapters of rank `rank`."""
    for allowed in ENGINE_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(
        f"LoRA rank {rank} exceeds vLLM's largest --max-lora-rank {MAX_ENGINE_LORA_RANK}"
    )


@dataclass(frozen=True)
class AdapterServing:
    """What the engines need to serve adapters, from --actor.lora.* (never a flag of its own)."""

    rank: int  # the trained adapters' rank
    keep: int  # the newest adapters every engine keeps loaded (and on disk)
    name: str = ADAPTER_PREFIX

    def adapter(self, version: int) -> str:
        return adapter_name(self.name, version)

    def server_env(self) -> dict[str, str]:
        # The server mounts /v1/load_lora_adapter and /v1/unload_lora_adapter only with it.
        return {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}

    def server_args(self) -> list[str]:
        # `keep` run in one batch, and one more stays in the host cache: none is read again.
        lora = ["--enable-lora", "--max-lora-rank", str(engine_lora_rank(self.rank))]
        return lora + ["--max-loras", str(self.keep), "--max-cpu-loras", str(self.keep + 1)]


def retired_adapter(path: Path) -> Path:
    """The adapter at `path` with every B zeroed (the base policy), written beside it."""
    from safetensors.torch import load_file, save_file

    out = path.parent / "retired"
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(path / "adapter_model.safetensors")
    zeroed = {n: t.zero_() if ".lora_B." in n else t for n, t in tensors.items()}
    save_file(zeroed, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_bytes((path / "adapter_config.json").read_bytes())
    return out


class AdapterRefitter(EngineSet):
    """The trainer's rank 0's refitter for adapters, in place of a `Refitter`."""

    def __init__(
        self, engine_urls: list[str], cfg: RefitConfig, serving: AdapterServing, token=None
    ) -> None:
        """The engines read the adapter directories: across nodes, from a filesystem they share."""
        super().__init__([EngineControl(url, cfg.timeout_s, token) for url in engine_urls], cfg)
        self.serving, self.token = serving, token
        self.kept: list[tuple[int, str]] = []  # (version, directory) in the window, oldest first
        self.retired: Path | None = None  # what a retired version's files become (docstring)
        # engine URL -> the adapter names it holds
        self.loaded: dict[str, set[str]] = {url: set() for url in engine_urls}

    def set_engines(self, engine_urls: list[str]) -> None:
        """The engines to serve (after a restart, the next `refit` loads the new one's)."""
        known = {engine.url: engine for engine in self.engines}
        token, timeout_s = self.token, self.cfg.timeout_s
        self.engines = [known.get(u) or EngineControl(u, timeout_s, token) for u in engine_urls]
        self.loaded = {url: self.loaded.get(url, set()) for url in engine_urls}

    def refit(self, version: int, path: str) -> dict[str, float]:
        """Serve the adapter at `path` as `version` on every engine that lacks it."""
        name = self.serving.adapter(version)
        start = time.perf_counter()
        if self.retired is None:
            self.retired = retired_adapter(Path(path))

        def load(engine: EngineControl) -> None:
            if name in self.loaded[engine.url]:
                return
            try:
                engine.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
            except RefitError as error:  # vLLM names what it cannot serve (targets, rank)
                raise RefitError(f"--actor.lora.refit adapter: {error}") from None
            self.loaded[engine.url].add(name)

        self._on_all(load)
        loaded = time.perf_counter()
        self.set_version(version)  # only now: every engine has the adapter a client will name
        versioned = time.perf_counter()
        if not self.kept or self.kept[-1][0] != version:
            self.kept.append((version, path))
        while len(self.kept) > self.serving.keep:
            self._drop(*self.kept.pop(0))
        end = time.perf_counter()
        return {
            "refit/bytes": float(sum(f.stat().st_size for f in Path(path).iterdir())),
            "timing/refit_load": loaded - start,
            "timing/refit_finish": versioned - loaded,
            "timing/refit_unload": end - versioned,
            "timing/refit_total": end - start,
        }

    def _drop(self, version: int, path: str) -> None:
        name = self.serving.adapter(version)

        def unload(engine: EngineControl) -> None:
            if name in self.loaded[engine.url]:
                with contextlib.suppress(RefitError):  # gone already: nothing to unload
                    engine.post("/v1/unload_lora_adapter", {"lora_name": name})
                self.loaded[engine.url].discard(name)

        self._on_all(unload)
        for file in self.retired.iterdir():  # each file replaced at once: never a missing one
            link = Path(path) / f".{file.name}.retiring"
            link.unlink(missing_ok=True)
            try:
                os.link(file, link)
            except OSError:  # a file system without hard links: a copy, the adapter's size
                shutil.copyfile(file, link)
            os.replace(link, Path(path) / file.name)
