"""Refit: new trainer weights into every engine through vLLM's own weight-transfer protocol.

One refit, for all engines at once, bypassing the router (the first bucket is gathered while
the engines still generate):
  pause(keep)        in-flight requests stay queued with their KV; nothing is aborted or
                     preempted (a text model keeps its KV cache: fast_pause.py)
  start_weight_update
  update_weights     one call per bucket of tensors, concurrent with the trainer's broadcast;
                     the trainer gathers the next bucket while the engines load this one
  finish_weight_update(version)   the new version is what tokens report from now on
  resume             kept requests continue under the new weights (partial rollout)
New requests cannot reuse prefix-cache blocks computed under the old weights: the token client
salts the cache with the weight version (client.py). Kept requests keep their own KV.
Each phase is timed (`timing/refit_*`); every HTTP call and collective has a timeout that
raises `RefitError`.

Transports (the wire under `update_weights`): `GlooTransport`, Molt's CPU backend (see
cpu_transport.py); `NcclTransport`, vLLM's NCCL backend, for engines on other GPUs; and
`IpcTransport`, Molt's CUDA-IPC backend (ipc_transport.py), for an engine sharing the trainer's
GPU (`--train.colocate`). All ship buckets of about `--refit.bucket_mb`, never one call per tensor.
"""

import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict
from datetime import timedelta
from urllib.parse import urlsplit

import httpx
import torch
import torch.distributed as dist

from molt_rollout.buckets import iter_buckets, pack, packed_size
from molt_rollout.config import RefitConfig
from molt_rollout.network import SINGLE_NODE, Network, check_reachable
from molt_rollout.vllm_compat import nccl_packed_fields


class RefitError(RuntimeError):
    pass


class EngineControl:
    """One engine's RL control endpoints (mounted by VLLM_SERVER_DEV_MODE=1)."""

    def __init__(self, url: str, timeout_s: float, token: str | None = None) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=timeout_s,
                                 headers=Network(token=token).headers())  # fmt: skip

    def post(self, path: str, json: dict | None = None, **params) -> dict:
        try:
            response = self.http.post(path, json=json, params=params or None)
        except httpx.HTTPError as error:
            raise RefitError(f"{self.url}{path} failed: {error!r}") from error
        if response.status_code >= 400:
            raise RefitError(
                f"{self.url}{path} answered {response.status_code}: {response.text[:1000]}"
            )
        try:
            return response.json() if response.content else {}
        except ValueError:  # vLLM's LoRA routes answer plain text
            return {"text": response.text}

    def weight_version(self) -> str:
        try:
            return self.http.get("/weight_info").json()["weight_version"]
        except (httpx.HTTPError, ValueError, KeyError) as error:
            raise RefitError(f"{self.url}/weight_info failed: {error!r}") from error

    def checksums(self) -> dict[str, str]:
        return self.post("/weight_checker", {"action": "checksum"})["checksums"]


class GlooTransport:
    """Trainer side of Molt's CPU backend: rank 0 of a gloo group with every engine worker,
    whose TCPStore rendezvous it hosts at `address` (its own node's)."""

    backend = "molt_gloo"

    def __init__(self, world_size: int, timeout_s: float, address: str) -> None:
        self.world_size, self.timeout = world_size, timedelta(seconds=timeout_s)
        # Port 0: the store binds a free port itself; one picked first and bound later could be
        # taken in between (CI saw EADDRINUSE in the two-node run).
        self.store = dist.TCPStore(address, 0, world_size, is_master=True,
                                   timeout=self.timeout, wait_for_workers=False)  # fmt: skip
        self.address, self.port = address, self.store.port
        self.group: dist.ProcessGroup | None = None

    def worker_init_info(self, rank_offset: int) -> dict:
        return {"master_address": self.address, "master_port": self.port,
                "rank_offset": rank_offset, "world_size": self.world_size,
                "timeout_s": self.timeout.total_seconds()}  # fmt: skip

    def connect(self) -> None:
        self.group = dist.ProcessGroupGloo(self.store, 0, self.world_size, self.timeout)

    def bucket_fields(self, tensors: list[torch.Tensor], index: int,
                      dtype: torch.dtype | None) -> dict:  # fmt: skip
        return {}

    def send(self, tensors: list[torch.Tensor], dtype: torch.dtype | None) -> None:
        self.group.broadcast(pack(tensors, dtype=dtype), 0).wait()


class NcclTransport:
    """Trainer side of vLLM's NCCL backend (GPU): packed broadcasts from rank 0, one bucket per
    `update_weights` call, in vLLM's own packed format."""

    backend = "nccl"

    def __init__(self, world_size: int, timeout_s: float, bucket_bytes: int, address: str) -> None:
        self.world_size, self.bucket_bytes, self.address = world_size, bucket_bytes, address
        self.timeout_s = timeout_s
        # The rendezvous store listens on a socket bound here, to a port the system picks: one
        # picked first and bound later could be taken in between (as the gloo store's was).
        self.listener = socket.create_server((address, 0))
        self.port = self.listener.getsockname()[1]
        self.group = None
        self.init_fields, self.update_fields = nccl_packed_fields(bucket_bytes)

    def worker_init_info(self, rank_offset: int) -> dict:
        return {"master_address": self.address, "master_port": self.port, "rank_offset": rank_offset,
                "world_size": self.world_size, **self.init_fields}  # fmt: skip

    def bucket_fields(self, tensors: list[torch.Tensor], index: int,
                      dtype: torch.dtype | None) -> dict:  # fmt: skip
        return self.update_fields

    def connect(self) -> None:
        """vLLM's trainer side of the group (nccl_common.trainer_init), on the bound socket."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        store = StatelessProcessGroup.create(self.address, self.port, 0, self.world_size,
                                             store_timeout=int(self.timeout_s),
                                             listen_socket=self.listener)  # fmt: skip
        self.group = PyNcclCommunicator(store, device=torch.cuda.current_device())

    def send(self, tensors: list[torch.Tensor], dtype: torch.dtype | None) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        packed_nccl_broadcast_producer(
            iterator=iter(tensors), group=self.group, src=0,
            post_iter_func=lambda t: t.to(dtype or t.dtype),
            buffer_size_bytes=self.bucket_bytes, num_buffers=2,
        )  # fmt: skip
        torch.cuda.current_stream().synchronize()


class IpcTransport:
    """Trainer side of Molt's CUDA-IPC backend (ipc_transport.py), for an engine on the
    trainer's own GPU: each bucket is copied into a staging buffer, shared with the engine
    once, and named in the `update_weights` call itself (no process group, no rendezvous).
    Two buffers, used in turn, so the trainer gathers and packs the next bucket while the
    engine loads this one (`Refitter.refit`). Each grows to the largest bucket it holds
    (`--refit.bucket_mb`, or a larger tensor alone) during the first refit and stays allocated
    for the run."""

    backend = "molt_ipc"
    address = port = None  # no rendezvous: the buffer's handle travels in the HTTP calls
    SLOTS = 2

    def __init__(self) -> None:
        self.staging: list[torch.Tensor | None] = [None] * self.SLOTS
        self.shared: list[dict] = [{}] * self.SLOTS  # ipc_transport.share of each, made once

    def worker_init_info(self, rank_offset: int) -> dict:
        return {}

    def connect(self) -> None:
        pass

    def bucket_fields(self, tensors: list[torch.Tensor], index: int,
                      dtype: torch.dtype | None) -> dict:  # fmt: skip
        """Packs bucket `index` of a refit into its buffer (the same one every refit, so the
        engine's recorded copies for it stay valid). The engines are done with that buffer:
        its last bucket's replies came before the previous bucket was sent."""
        from molt_rollout.ipc_transport import share

        slot = index % self.SLOTS
        needed = packed_size(tensors, dtype)
        if self.staging[slot] is None or self.staging[slot].numel() < needed:
            # as large as the other's too: a buffer that grows again drops its recorded copies
            size = max([needed] + [b.numel() for b in self.staging if b is not None])
            self.staging[slot] = None
            torch.cuda.ipc_collect()  # frees buffers the engine let go of (at its next map)
            self.staging[slot] = torch.empty(size, dtype=torch.uint8, device=tensors[0].device)
            self.shared[slot] = {**share(self.staging[slot]), "slot": slot}
        pack(tensors, out=self.staging[slot], dtype=dtype)
        torch.cuda.current_stream().synchronize()  # the engine reads it from its own stream
        return {"buffer": self.shared[slot]}

    def send(self, tensors: list[torch.Tensor], dtype: torch.dtype | None) -> None:
        pass  # the update call carries the buffer


class EngineSet:
    """The engines a refit drives, called all at once from a thread pool (a Refitter's and an
    AdapterRefitter's common part)."""

    def __init__(self, engines: list[EngineControl], cfg: RefitConfig) -> None:
        self.cfg, self.engines = cfg, engines
        self.pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(engines)))

    def _on_all(self, call: Callable[[EngineControl], object], calls: int = 1) -> list:
        """`call` on every engine at once; it makes `calls` HTTP calls, each within the timeout."""
        futures = [self.pool.submit(call, engine) for engine in self.engines]
        return [f.result(timeout=calls * self.cfg.timeout_s) for f in futures]

    def set_version(self, version: int) -> None:
        self._on_all(lambda e: e.post("/update_weight_version", {"new_version": str(version)}))

    def close(self) -> None:
        self.pool.shutdown(wait=False)


class Refitter(EngineSet):
    """Drives init once and then every refit across all engines."""

    def __init__(self, engine_urls: list[str], workers_per_engine: int, cfg: RefitConfig,
                 on_gpu: bool, colocated: bool = False,
                 network: Network = SINGLE_NODE) -> None:  # fmt: skip
        """`network`: the rendezvous listens on this process's node address across nodes, and
        every control call carries the run's token."""
        for i, url in enumerate(engine_urls):  # a clear error, not a refit that times out
            check_reachable(url, f"refit (the trainer's rank 0) dialling engine {i}")
        super().__init__([EngineControl(u, cfg.timeout_s, network.token) for u in engine_urls], cfg)
        self.workers_per_engine = workers_per_engine
        world_size = 1 + workers_per_engine * len(engine_urls)
        backend = transfer_backend(cfg, on_gpu, colocated)
        if backend == IpcTransport.backend:
            self.transport = IpcTransport()
        elif backend == "nccl":
            self.transport = NcclTransport(
                world_size, cfg.timeout_s, cfg.bucket_mb << 20, network.host()
            )
        else:
            self.transport = GlooTransport(world_size, cfg.timeout_s, network.host())
        self.last_unupdated: list[str] = []  # with --refit.report_unupdated: the last refit's

    def init_transfer(self) -> None:
        """Rendezvous the trainer (rank 0) with every engine worker: once per run, and again
        (a new Refitter, after `release` of the old one) when an engine was restarted."""
        futures = [
            self.pool.submit(engine.post, "/init_weight_transfer_engine",
                             {"init_info": self.transport.worker_init_info(1 + i * self.workers_per_engine)})
            for i, engine in enumerate(self.engines)
        ]  # fmt: skip
        failed: list[Exception] = []

        def connect() -> None:  # a daemon thread, not the pool: a hung one never blocks exit
            try:
                self.transport.connect()
            except Exception as error:  # raised below, in the caller's thread
                failed.append(error)

        connector = threading.Thread(target=connect, daemon=True)
        connector.start()
        for i, future in enumerate(futures):
            try:
                future.result(timeout=self.cfg.timeout_s)
            except (RefitError, FutureTimeout) as error:
                raise RefitError(self._not_joined(i, error)) from None
        connector.join(self.cfg.timeout_s)
        if connector.is_alive():
            raise RefitError(f"weight-transfer rendezvous timed out after {self.cfg.timeout_s} s")
        if failed:  # every engine joined, yet the trainer's side failed
            raise RefitError(f"the trainer's side of the weight-transfer rendezvous failed: "
                             f"{failed[0]}") from failed[0]  # fmt: skip

    def _not_joined(self, i: int, error: Exception) -> str:
        """Why engine i did not join the rendezvous, naming both ends (an engine's node that
        cannot reach rank 0's port is the usual cause across nodes)."""
        engine = urlsplit(self.engines[i].url).hostname
        address, port = self.transport.address, self.transport.port
        where = f" at {address} port {port}" if address else ""
        return (f"engine {i} ({engine}) did not join the weight-transfer rendezvous that the "
                f"trainer's rank 0 hosts{where} within --refit.timeout_s "
                f"({self.cfg.timeout_s:.0f} s): can the engine's node reach that port? "
                f"{error or type(error).__name__}")  # fmt: skip

    def pause(self, mode: str = "keep") -> None:
        # keep_kv: requests kept across the refit keep their KV (fast_pause.py says when)
        self._on_all(lambda e: e.post("/pause", mode=mode, keep_kv="true"))

    def resume(self) -> None:
        self._on_all(lambda e: e.post("/resume"))

    def refit(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        pause_mode: str = "keep",
        dtype: torch.dtype | None = None,
    ) -> dict[str, float]:
        """pause -> transfer in buckets -> finish with `version` -> resume.

        `pause_mode` "keep" holds in-flight requests and continues them under the new weights
        (partial rollout: one rollout may span versions); "wait" lets them finish on the old
        weights first, so every request is generated by one version. `dtype`: the engines'
        (each tensor cast as it is packed; its own if None)."""
        times: dict[str, float] = {}
        before = self._on_all(EngineControl.checksums) if self.cfg.report_unupdated else None
        # Each bucket is gathered (the iterator) and packed while the engines load the one
        # before; the first while they still generate, before the pause.
        last = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal last
            now = time.perf_counter()
            times[f"timing/refit_{name}"] = now - last
            last = now

        updates = self._updates(named_tensors, dtype)
        ready = list(itertools.islice(updates, 1))  # bucket 0
        lap("first_bucket")
        start = last  # timing/refit_total: pause -> resume, what the engines feel
        self.pause(pause_mode)
        lap("pause")
        self._on_all(lambda e: e.post("/start_weight_update"))
        lap("start")
        num_buckets = num_bytes = 0
        waited = 0.0  # of the transfer, on the engines' loads (and the wire)
        replies: list[Future] = []
        for update, tensors, nbytes in itertools.chain(ready, updates):
            waited += self._wait(replies)
            replies, seconds = self._send(update, tensors, dtype)
            waited += seconds
            num_buckets += 1
            num_bytes += nbytes
        waited += self._wait(replies)
        lap("transfer")
        times["timing/refit_transfer_engines"] = waited
        self._on_all(lambda e: e.post("/finish_weight_update", {"weight_version": str(version)}))
        lap("finish")
        self.resume()
        lap("resume")
        times["timing/refit_total"] = time.perf_counter() - start
        times["refit/buckets"] = float(num_buckets)
        times["refit/bytes"] = float(num_bytes)  # to each engine
        if before is not None:
            after = self._on_all(EngineControl.checksums)
            unchanged = sorted(
                {n for b, a in zip(before, after, strict=True) for n in b if b[n] == a.get(n)}
            )
            times["refit/unupdated_params"] = float(len(unchanged))
            self.last_unupdated = unchanged
        return times

    def _updates(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                 dtype: torch.dtype | None) -> Iterator[tuple[dict, list[torch.Tensor], int]]:  # fmt: skip
        """Each bucket made ready to send: its `update_weights` body, tensors and size."""
        buckets = iter_buckets(named_tensors, self.cfg.bucket_mb << 20, dtype)
        for index, (meta, tensors) in enumerate(buckets):
            fields = self.transport.bucket_fields(tensors, index, dtype)
            yield {"update_info": {**asdict(meta), **fields}}, tensors, meta.numbytes()

    def _send(self, update: dict, tensors: list[torch.Tensor],
              dtype: torch.dtype | None) -> tuple[list[Future], float]:  # fmt: skip
        """One bucket to every engine: their replies to come, and the seconds the send took."""
        start = time.perf_counter()
        # Workers block inside update_weights until the broadcast arrives: run both at once.
        replies = [self.pool.submit(e.post, "/update_weights", update) for e in self.engines]
        self.transport.send(tensors, dtype)
        return replies, time.perf_counter() - start

    def _wait(self, replies: list[Future]) -> float:
        """Seconds until every engine answered its last bucket."""
        start = time.perf_counter()
        for reply in replies:
            reply.result(timeout=self.cfg.timeout_s)
        return time.perf_counter() - start

    def release(self) -> None:
        """End this weight-transfer group on every engine still running, so a new Refitter can
        rendezvous with them all (after an engine restart: vLLM's workers join one group at a
        time). A dead or replaced engine has nothing to release; its error is ignored.

        A refit cut short by an engine's death leaves the survivors' weight update open, and
        vLLM refuses to end a group during one: finish it first. Finishing with nothing loaded
        keeps the old weights and version; where no update is open, vLLM's refusal is ignored."""

        def shutdown(engine: EngineControl) -> None:
            with contextlib.suppress(RefitError):
                engine.post("/finish_weight_update")
            with contextlib.suppress(RefitError):
                engine.post("/shutdown_weight_transfer_engine")

        self._on_all(shutdown, calls=2)
        self.close()


def set_sleeping(engine_urls: list[str], sleeping: bool, mode: str, timeout_s: float,
                 token: str | None = None) -> None:  # fmt: skip
    """vLLM sleep mode, level 1 (weights to host memory, KV cache dropped), or wake up. `mode`
    is the pause mode for requests in flight (see Refitter.refit)."""
    for url in engine_urls:
        engine = EngineControl(url, timeout_s, token)
        if sleeping:
            engine.post("/sleep", level=1, mode=mode)
        else:
            engine.post("/wake_up")


def transfer_backend(cfg: RefitConfig, on_gpu: bool, colocated: bool = False) -> str:
    """auto: CUDA IPC to engines on the trainer's GPUs, NCCL to others, gloo on CPU."""
    if cfg.backend != "auto":
        return cfg.backend
    if not on_gpu:
        return GlooTransport.backend
    return IpcTransport.backend if colocated else NcclTransport.backend
