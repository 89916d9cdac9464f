"""vLLM engines: one OpenAI-compatible server process per engine, owned by a Ray actor that
holds its placement (GPUs) and lifetime; a dead server's error carries its last log lines."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import ray

from molt_rollout.config import GPU_MEMORY_UTILIZATION, VLLMConfig
from molt_rollout.engines import lifeline
from molt_rollout.network import LOOPBACK, SINGLE_NODE, Network, free_port
from molt_rollout.refit.auth import TOKEN_ENV
from molt_rollout.refit.vllm_compat import version_server_args

if TYPE_CHECKING:
    from molt_rollout.refit.adapters import AdapterServing

LOG_TAIL_LINES = 40
GPU_SERVER = "vllm.entrypoints.openai.api_server"
CPU_SERVER = "molt_rollout.refit.cpu_server"  # the same server, its engine core forked
COLOCATED_GPU_SHARE = 0.5  # Ray's bookkeeping only: memory is --vllm.gpu_memory_utilization


class EngineError(RuntimeError):
    """An engine failed to start, died, or stopped answering; the message has its log tail."""


class ServerProcess:
    """A server process tied to its owner by the lifeline: what an engine and the router share."""

    name: str
    log_path: Path
    process: subprocess.Popen | None = None
    url = ""

    def exit_error(self) -> EngineError | None:
        if self.process is None or self.process.poll() is None:
            return None
        return self._error(f"({self.url}) exited with code {self.process.returncode}")

    def _error(self, what: str) -> EngineError:
        tail = "(no log)"
        if self.log_path.exists():
            with self.log_path.open(errors="replace") as f:
                tail = "".join(deque(f, maxlen=LOG_TAIL_LINES))
        return EngineError(f"{self.name} {what}; last log lines of {self.log_path}:\n{tail}")

    def wait_ready(self, timeout_s: float, flag: str) -> None:
        """Until /health answers; EngineError if the server exits, or after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as http:  # one TLS context, not one per poll
            while time.monotonic() < deadline:
                if (error := self.exit_error()) is not None:
                    raise error
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(f"{self.url}/health").status_code == 200:
                        return
                time.sleep(0.25)
        self.stop()
        raise self._error(f"not ready after {timeout_s:.0f} s ({flag})")

    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def stop(self) -> None:
        """The server and its children (one process group)."""
        if self.process is not None:
            lifeline.stop(self.process)


def server_args(
    vllm: VLLMConfig,
    model: str,
    port: int,
    transfer_backend: str,
    adapters: AdapterServing | None = None,
    host: str = LOOPBACK,
    token_check: bool = False,
) -> list[str]:
    """The vLLM OpenAI server's command line of one engine (`adapters`: for the adapter refit;
    `token_check`: the run's token on every path but /health); `--vllm.extra_args` last."""
    # Middlewares: each added later wraps the earlier ones, so the versions' middleware sees
    # every /pause before Molt's answers it, and the token check comes first of all.
    args = ["--middleware", "molt_rollout.refit.fast_pause.Pause", *version_server_args()]
    if token_check:
        args += ["--middleware", "molt_rollout.refit.auth.RequireToken"]
    mtp = {"method": "mtp", "num_speculative_tokens": vllm.mtp_num_speculative_tokens}
    # vLLM's memory share is per server process, Molt's per GPU.
    memory_share = (vllm.gpu_memory_utilization or GPU_MEMORY_UTILIZATION) / vllm.engines_per_gpu
    flags = {  # True: the flag alone; None or False: left out
        "--model": model,
        "--host": host,
        "--port": port,
        "--logprobs-mode": "processed_logprobs",  # post-temperature, as the trainer recomputes
        "--weight-transfer-config": json.dumps({"backend": transfer_backend}),
        "--tensor-parallel-size": vllm.tensor_parallel_size,
        "--data-parallel-size": vllm.data_parallel_size,
        "--dtype": vllm.dtype,
        "--gpu-memory-utilization": memory_share,
        "--enable-prefix-caching": vllm.enable_prefix_caching,
        "--no-enable-prefix-caching": not vllm.enable_prefix_caching,
        "--enable-expert-parallel": vllm.enable_expert_parallel,
        "--max-num-batched-tokens": vllm.max_num_batched_tokens,
        "--max-model-len": vllm.max_model_len,
        "--enforce-eager": vllm.enforce_eager,
        "--enable-sleep-mode": vllm.enable_sleep_mode,
        "--speculative-config": json.dumps(mtp) if vllm.mtp_num_speculative_tokens else None,
        "--enable-return-routed-experts": vllm.enable_return_routed_experts,
    }
    for flag, value in flags.items():
        if value is not None and value is not False:
            args += [flag] if value is True else [flag, str(value)]
    if adapters is not None:
        args += adapters.server_args()
    return args + list(vllm.extra_args)


class EngineServer(ServerProcess):
    """One vLLM server process; `EngineActor` is the Ray actor that holds one."""

    def __init__(
        self,
        index: int,
        cfg: VLLMConfig,
        model: str,
        transfer_backend: str,
        log_dir: str,
        on_gpu: bool,
        adapters: AdapterServing | None = None,
        network: Network = SINGLE_NODE,
    ) -> None:
        self.cfg, self.model, self.adapters = cfg, model, adapters
        self.transfer_backend, self.on_gpu, self.network = transfer_backend, on_gpu, network
        self.name, self.log_path = f"engine {index}", Path(log_dir) / f"engine_{index}.log"

    def start(self) -> str:
        host = self.network.host()
        port = free_port(host)
        self.url = f"http://{host}:{port}"
        command = [sys.executable, "-m", GPU_SERVER if self.on_gpu else CPU_SERVER]
        args = (self.cfg, self.model, port, self.transfer_backend, self.adapters, host)
        command += server_args(*args, token_check=bool(self.network.token))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Appended to: a restarted engine's log keeps the lines of the death that caused it.
        with self.log_path.open("a") as log:
            print(" ".join(command), file=log, flush=True)
            # Tied to this actor's process: a killed driver (and so actor) leaves no server.
            env = self._env()
            self.process = lifeline.spawn(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.wait_ready(self.cfg.startup_timeout_s, "--vllm.startup_timeout_s")
        return self.url

    def _env(self) -> dict[str, str]:
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # mounts the RL control endpoints
        if self.network.token:  # in the environment: a command line is readable by anyone
            env[TOKEN_ENV] = self.network.token
        if not self.on_gpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.cfg.cpu_kvcache_gib)
            # The model runs in the engine-core process: as a worker process of its own it
            # busy-polls its queue, a whole core of two (docs/performance.md).
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            # vllm-cpu 0.32 never loads its AOT-compiled model back and compiles again at every
            # start; without AOT it loads inductor's cache (docs/performance.md).
            env.setdefault("VLLM_USE_AOT_COMPILE", "0")
        if self.adapters is not None:
            env.update(self.adapters.server_env())
        return env


EngineActor = ray.remote(num_cpus=0)(EngineServer)


def gpu_bundles(n: int, resources: dict[str, float] | None = None):
    """A ready Ray placement group of `n` one-GPU bundles (with `resources`), packed."""
    from ray.util.placement_group import placement_group

    bundles = placement_group([{"GPU": 1, "CPU": 1, **(resources or {})}] * n, strategy="PACK")
    ray.get(bundles.ready(), timeout=600)
    return bundles


def start_waves(num_engines: int, per_gpu: int) -> list[range]:
    """The engines to start together, wave after wave: one engine of each GPU per wave."""
    return [range(wave, num_engines, per_gpu) for wave in range(per_gpu)]


class EngineGroup:
    """The run's engines. `placement`: one-GPU bundles shared with the trainer
    (--train.colocate), engine i taking a share of bundle i // engines_per_gpu; None: GPUs of
    their own (in bundles of the group's own with several engines a GPU)."""

    def __init__(
        self,
        cfg: VLLMConfig,
        model: str,
        transfer_backend: str,
        log_dir: str,
        on_gpu: bool,
        placement=None,
        adapters: AdapterServing | None = None,
        network: Network = SINGLE_NODE,
    ) -> None:
        self.cfg, per_gpu = cfg, cfg.engines_per_gpu
        self.own_placement = None
        if placement is None and per_gpu > 1:
            resources = {k: v * per_gpu for k, v in cfg.ray_resources.items()}
            placement = self.own_placement = gpu_bundles(cfg.num_engines // per_gpu, resources)
        args = (cfg, model, transfer_backend, log_dir, on_gpu, adapters, network)
        self.actors = [
            EngineActor.options(**self._placement(i, on_gpu, placement)).remote(i, *args)
            for i in range(cfg.num_engines)
        ]
        self.urls: list[str] = []

    def _placement(self, i: int, on_gpu: bool, placement) -> dict:
        """Engine i's Ray options: GPUs of its own, or its share of a bundle's GPU."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg, resources = self.cfg, dict(self.cfg.ray_resources)
        if placement is None:
            gpus = cfg.tensor_parallel_size * cfg.data_parallel_size if on_gpu else 0
            return {"num_gpus": gpus, "resources": resources}
        own = self.own_placement is not None
        bundle = i // cfg.engines_per_gpu
        strategy = PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=bundle)
        share = (1.0 if own else COLOCATED_GPU_SHARE) / cfg.engines_per_gpu
        options = {"num_gpus": share, "resources": resources if own else {}}
        return {**options, "scheduling_strategy": strategy}

    def start(self) -> list[str]:
        """All engines; those sharing a GPU one after the other: vLLM sizes its KV cache from
        the memory it sees in use, and would count a neighbour's allocations as its own."""
        urls: dict[int, str] = {}
        timeout_s = self.cfg.startup_timeout_s + 30
        for wave in start_waves(self.cfg.num_engines, self.cfg.engines_per_gpu):
            started = ray.get([self.actors[i].start.remote() for i in wave], timeout=timeout_s)
            urls.update(zip(wave, started, strict=True))
        self.urls = [urls[i] for i in range(self.cfg.num_engines)]
        return self.urls

    def check(self) -> None:
        for error in self.dead().values():
            raise error

    def dead(self) -> dict[int, EngineError]:
        errors = ray.get([a.exit_error.remote() for a in self.actors], timeout=30)
        return {i: e for i, e in enumerate(errors) if e is not None}

    def restart(self, index: int) -> str:
        """Engine `index` on a new server (the old one's process group ended first), with the
        model's initial weights until the trainer refits it; its new URL (also in `urls`)."""
        actor = self.actors[index]
        actor.stop.remote()  # an actor runs its calls in order
        self.urls[index] = ray.get(actor.start.remote(), timeout=self.cfg.startup_timeout_s + 30)
        return self.urls[index]

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
