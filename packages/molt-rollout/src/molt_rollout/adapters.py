"""Adapter refit: the engines serve the policy as the base model plus one LoRA adapter per
weight version, through vLLM's own LoRA support (`--actor.lora.refit adapter`).

The trainer's rank 0 writes the adapters alone (A and B of every adapted layer) as a PEFT
checkpoint, one directory per version, and `AdapterRefitter.refit` makes every engine serve it:

  POST /v1/load_lora_adapter {lora_name: "<name>-v<N>", lora_path}   every engine, then
  POST /update_weight_version {new_version: N}                        every engine, then
  POST /v1/unload_lora_adapter for the version leaving the window, and its files retired

No pause and no weight transfer: a request names its adapter (`model`, client.py), so it runs
wholly under the version it named, whatever refits land meanwhile, and the base weights never
change. An engine reports version N only once every engine holds adapter N, so a client that
read N from any engine finds adapter N on whichever engine the router picks.

The window. Each engine keeps the newest `keep` adapters loaded, and their directories stay on
disk; the trainer sizes `keep` from its staleness bound (molt_train.config.adapter_serving):
the versions whose tokens it can still train. Older ones are unloaded: a request that names
one gets a 404 and the client asks again with the current version. vLLM's engine keeps
`keep + 1` adapters in its host cache (`--max-cpu-loras`), so an adapter in the window never
has to be read from disk again, and `keep` may run in one batch (`--max-loras`), so no request
of the window waits for an adapter slot.

Retired versions. A request already in an engine when its adapter leaves the window still
holds the adapter's path, and vLLM reloads it from there if its cache evicted it meanwhile; a
missing directory then kills the engine core (vLLM 0.32: LoRAAdapterNotFoundError, seen with a
request held across `keep + 1` refits). Such a request's tokens can no longer be trained (the
pool drops tokens staler than the bound at the very refit that retires their adapter), so a
retired version's files are replaced, each atomically, by hard links to one retired adapter:
the first refit's adapter with B = 0 (the base policy). The engine then always finds a valid
adapter, and a retired version costs no disk.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from molt_rollout.client import adapter_name
from molt_rollout.config import RefitConfig
from molt_rollout.refit import EngineControl, EngineSet, RefitError

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
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest --max-lora-rank "
                     f"{MAX_ENGINE_LORA_RANK}")  # fmt: skip


@dataclass(frozen=True)
class AdapterServing:
    """What the engines need to serve adapters: set by the trainer (from --actor.lora.*), never
    a flag of its own, so the engines' LoRA settings cannot disagree with what trains."""

    rank: int  # the trained adapters' rank
    keep: int  # the newest adapters every engine keeps loaded (and on disk)
    name: str = ADAPTER_PREFIX

    def adapter(self, version: int) -> str:
        return adapter_name(self.name, version)

    def server_env(self) -> dict[str, str]:
        # The server mounts /v1/load_lora_adapter and /v1/unload_lora_adapter only with it.
        return {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}

    def server_args(self) -> list[str]:
        return [
            "--enable-lora",
            "--max-lora-rank", str(engine_lora_rank(self.rank)),
            "--max-loras", str(self.keep),
            "--max-cpu-loras", str(self.keep + 1),
        ]  # fmt: skip


def retired_adapter(path: Path) -> Path:
    """The adapter at `path` with every B set to zero (the base policy), written beside it as
    `retired/`: what retired versions' files are hard links to."""
    from safetensors.torch import load_file, save_file

    out = path.parent / "retired"
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(path / "adapter_model.safetensors")
    zeroed = {n: t.zero_() if ".lora_B." in n else t for n, t in tensors.items()}
    save_file(zeroed, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_bytes((path / "adapter_config.json").read_bytes())
    return out


class AdapterRefitter(EngineSet):
    """Loads each version's adapter into every engine, sets the version, unloads the ones
    that left the window. The trainer's rank 0 owns one, in place of a `Refitter`."""

    def __init__(self, engine_urls: list[str], cfg: RefitConfig, serving: AdapterServing,
                 token: str | None = None) -> None:  # fmt: skip
        """`token`: the run's token, for engines on other nodes (molt_rollout.network). The
        adapter directories are read by the engines: across nodes, a filesystem they share."""
        super().__init__([EngineControl(url, cfg.timeout_s, token) for url in engine_urls], cfg)
        self.serving, self.token = serving, token
        self.kept: list[tuple[int, str]] = []  # (version, directory) in the window, oldest first
        self.retired: Path | None = None  # what a retired version's files become (docstring)
        self.loaded: dict[str, set[str]] = {}  # engine URL -> the adapter names it holds
        self.set_engines(engine_urls)

    def set_engines(self, engine_urls: list[str]) -> None:
        """The engines to serve (again, after a restart: a new server has a new URL and no
        adapter; the next `refit` loads the current one there)."""
        known = {engine.url: engine for engine in self.engines}
        self.engines = [known.get(url) or EngineControl(url, self.cfg.timeout_s, self.token)
                        for url in engine_urls]  # fmt: skip
        self.loaded = {url: self.loaded.get(url, set()) for url in engine_urls}

    def refit(self, version: int, path: str) -> dict[str, float]:
        """Serve the adapter written at `path` as `version` on every engine. Again for the same
        version (an engine restarted) loads it only where it is missing."""
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

    def release(self) -> None:
        """Nothing to end on the engines (no transfer group): see `set_engines`."""
