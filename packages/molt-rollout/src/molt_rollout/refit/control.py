"""Refit through vLLM's weight-transfer protocol, all engines at once: pause, start, one
update_weights per bucket (the next packed while the engines load this one), finish (version),
resume; each call within --refit.timeout_s. See docs/concepts/refit.md."""

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

from molt_rollout.config import RefitConfig
from molt_rollout.network import SINGLE_NODE, Network, check_reachable
from molt_rollout.refit.buckets import iter_buckets, pack, packed_size
from molt_rollout.refit.vllm_compat import nccl_packed_fields


class RefitError(RuntimeError):
    """A control call or collective of the refit failed or timed out."""


class EngineControl:
    """One engine's RL control endpoints (mounted by VLLM_SERVER_DEV_MODE=1), or the router's."""

    def __init__(self, url: str, timeout_s: float, token: str | None = None) -> None:
        self.url = url
        headers = Network(token=token).headers()
        self.http = httpx.Client(base_url=url, timeout=timeout_s, headers=headers)

    def post(self, path: str, json: dict | None = None, **params) -> dict:
        try:
            response = self.http.post(path, json=json, params=params or None)
        except httpx.HTTPError as error:
            raise RefitError(f"{self.url}{path} failed: {error!r}") from error
        if response.status_code >= 400:
            status, text = response.status_code, response.text[:1000]
            raise RefitError(f"{self.url}{path} answered {status}: {text}")
        try:
            return response.json() if response.content else {}
        except ValueError:  # vLLM's LoRA routes answer plain text
            return {"text": response.text}

    def checksums(self) -> dict[str, str]:
        return self.post("/weight_checker", {"action": "checksum"})["checksums"]


class Rendezvous:
    """A transport whose group the trainer (rank 0) hosts at `address`, `port`; `init_fields`
    go to every worker's init, `update_fields` with every bucket."""

    def worker_init_info(self, rank_offset: int) -> dict:
        where = {"master_address": self.address, "master_port": self.port}
        group = {"rank_offset": rank_offset, "world_size": self.world_size}
        return {**where, **group, **self.init_fields}

    def bucket_fields(self, tensors: list[torch.Tensor], index: int, dtype) -> dict:
        return self.update_fields


class GlooTransport(Rendezvous):
    """Molt's CPU backend: rank 0 of a gloo group with every engine worker."""

    backend = "molt_gloo"

    def __init__(self, world_size: int, cfg: RefitConfig, address: str) -> None:
        self.world_size, self.timeout = world_size, timedelta(seconds=cfg.timeout_s)
        # Port 0: the store binds a free port itself; one picked first could be taken meanwhile.
        self.store = dist.TCPStore(
            address, 0, world_size, is_master=True, timeout=self.timeout, wait_for_workers=False
        )
        self.address, self.port = address, self.store.port
        self.init_fields, self.update_fields = {"timeout_s": cfg.timeout_s}, {}
        self.group: dist.ProcessGroup | None = None

    def connect(self) -> None:
        self.group = dist.ProcessGroupGloo(self.store, 0, self.world_size, self.timeout)

    def send(self, tensors: list[torch.Tensor], dtype: torch.dtype | None) -> None:
        self.group.broadcast(pack(tensors, dtype=dtype), 0).wait()


class NcclTransport(Rendezvous):
    """vLLM's NCCL backend (GPU): packed broadcasts from rank 0, one bucket per update call."""

    backend = "nccl"

    def __init__(self, world_size: int, cfg: RefitConfig, address: str) -> None:
        self.world_size, self.bucket_bytes, self.address = world_size, cfg.bucket_mb << 20, address
        self.timeout_s = cfg.timeout_s
        # The store listens on a socket bound now, as the gloo store does.
        self.listener = socket.create_server((address, 0))
        self.port = self.listener.getsockname()[1]
        self.group = None
        self.init_fields, self.update_fields = nccl_packed_fields(self.bucket_bytes)

    def connect(self) -> None:
        """vLLM's trainer side of the group (nccl_common.trainer_init), on the bound socket."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        wait = {"store_timeout": int(self.timeout_s), "listen_socket": self.listener}
        store = StatelessProcessGroup.create(self.address, self.port, 0, self.world_size, **wait)
        self.group = PyNcclCommunicator(store, device=torch.cuda.current_device())

    def send(self, tensors: list[torch.Tensor], dtype: torch.dtype | None) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        packed_nccl_broadcast_producer(
            iter(tensors), self.group, 0, lambda t: t.to(dtype or t.dtype), self.bucket_bytes, 2
        )
        torch.cuda.current_stream().synchronize()


class IpcTransport:
    """Molt's CUDA-IPC backend (ipc_transport.py): buckets packed into two staging buffers used
    in turn, each shared once, grown to the largest bucket it holds and kept for the run."""

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

    def bucket_fields(self, tensors: list[torch.Tensor], index: int, dtype) -> dict:
        """Packs bucket `index` into its slot's buffer (the engines answered its last bucket)."""
        from molt_rollout.refit.ipc_transport import share

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
    """The engines a refit drives, called all at once from a thread pool."""

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

    def __init__(
        self,
        engine_urls: list[str],
        workers_per_engine: int,
        cfg: RefitConfig,
        on_gpu: bool,
        colocated: bool = False,
        network: Network = SINGLE_NODE,
    ) -> None:
        """`network`: the rendezvous's address, and the token of every control call."""
        for i, url in enumerate(engine_urls):  # a clear error, not a refit that times out
            check_reachable(url, f"refit (the trainer's rank 0) dialling engine {i}")
        super().__init__([EngineControl(u, cfg.timeout_s, network.token) for u in engine_urls], cfg)
        self.workers_per_engine = workers_per_engine
        world_size = 1 + workers_per_engine * len(engine_urls)
        backend = transfer_backend(cfg, on_gpu, colocated)
        if backend == IpcTransport.backend:
            self.transport = IpcTransport()
        else:
            kind = NcclTransport if backend == NcclTransport.backend else GlooTransport
            self.transport = kind(world_size, cfg, network.host())
        self.last_unupdated: list[str] = []  # with --refit.report_unupdated: the last refit's

    def init_transfer(self) -> None:
        """Rendezvous the trainer (rank 0) with every engine worker: once per run, and again (a
        new Refitter, after `release`) when an engine was restarted."""

        def join(i: int, engine: EngineControl) -> dict:
            info = self.transport.worker_init_info(1 + i * self.workers_per_engine)
            return engine.post("/init_weight_transfer_engine", {"init_info": info})

        joins = [self.pool.submit(join, i, engine) for i, engine in enumerate(self.engines)]
        failed: list[Exception] = []

        def connect() -> None:  # a daemon thread, not the pool: a hung one never blocks exit
            try:
                self.transport.connect()
            except Exception as error:  # raised below, in the caller's thread
                failed.append(error)

        connector = threading.Thread(target=connect, daemon=True)
        connector.start()
        for i, future in enumerate(joins):
            try:
                future.result(timeout=self.cfg.timeout_s)
            except (RefitError, FutureTimeout) as error:
                raise RefitError(self._not_joined(i, error)) from None
        connector.join(self.cfg.timeout_s)
        if connector.is_alive():
            raise RefitError(f"weight-transfer rendezvous timed out after {self.cfg.timeout_s} s")
        if failed:  # every engine joined, yet the trainer's side failed
            message = f"the trainer's side of the weight-transfer rendezvous failed: {failed[0]}"
            raise RefitError(message) from failed[0]

    def _not_joined(self, i: int, error: Exception) -> str:
        """Why engine i did not join, naming both ends (across nodes, usually a closed port)."""
        engine = urlsplit(self.engines[i].url).hostname
        address, port = self.transport.address, self.transport.port
        where = f" at {address} port {port}" if address else ""
        return (
            f"engine {i} ({engine}) did not join the weight-transfer rendezvous that the "
            f"trainer's rank 0 hosts{where} within --refit.timeout_s ({self.cfg.timeout_s:.0f} "
            f"s): can the engine's node reach that port? {error or type(error).__name__}"
        )

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
        """pause -> transfer in buckets -> finish with `version` -> resume. `pause_mode` "keep"
        continues requests in flight under the new weights, "wait" finishes them on the old
        ones first. `dtype`: the engines' (each tensor cast as it is packed)."""
        times: dict[str, float] = {}
        before = self._on_all(EngineControl.checksums) if self.cfg.report_unupdated else None
        last = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal last
            times[f"timing/refit_{name}"] = time.perf_counter() - last
            last = time.perf_counter()

        updates = self._updates(named_tensors, dtype)
        ready = list(itertools.islice(updates, 1))  # bucket 0, while the engines still generate
        lap("first_bucket")
        start = last  # timing/refit_total: pause -> resume, what the engines feel
        self.pause(pause_mode)
        lap("pause")
        self._on_all(lambda e: e.post("/start_weight_update"))
        lap("start")
        buckets = size = 0
        waited = 0.0  # of the transfer, on the engines' loads and the wire
        replies: list[Future] = []
        for update, tensors, nbytes in itertools.chain(ready, updates):
            sent = time.perf_counter()
            self._wait(replies)  # the engines loaded the last bucket: its buffer is free
            # Workers block inside update_weights until the broadcast arrives: both at once.
            replies = [self.pool.submit(e.post, "/update_weights", update) for e in self.engines]
            self.transport.send(tensors, dtype)
            waited += time.perf_counter() - sent
            buckets, size = buckets + 1, size + nbytes
        waited += self._wait(replies)
        lap("transfer")
        times["timing/refit_transfer_engines"] = waited
        self._on_all(lambda e: e.post("/finish_weight_update", {"weight_version": str(version)}))
        lap("finish")
        self.resume()
        lap("resume")
        times["timing/refit_total"] = time.perf_counter() - start
        times["refit/buckets"], times["refit/bytes"] = float(buckets), float(size)
        if before is not None:
            after = self._on_all(EngineControl.checksums)
            pairs = zip(before, after, strict=True)
            self.last_unupdated = sorted({n for b, a in pairs for n in b if b[n] == a.get(n)})
            times["refit/unupdated_params"] = float(len(self.last_unupdated))
        return times

    def _updates(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
    ) -> Iterator[tuple[dict, list[torch.Tensor], int]]:
        """Each bucket made ready to send: its `update_weights` body, tensors and size."""
        buckets = iter_buckets(named_tensors, self.cfg.bucket_mb << 20, dtype)
        for index, (meta, tensors) in enumerate(buckets):
            fields = self.transport.bucket_fields(tensors, index, dtype)
            yield {"update_info": {**asdict(meta), **fields}}, tensors, meta.numbytes()

    def _wait(self, replies: list[Future]) -> float:
        """Seconds until every engine answered its last bucket."""
        start = time.perf_counter()
        for reply in replies:
            reply.result(timeout=self.cfg.timeout_s)
        return time.perf_counter() - start

    def release(self) -> None:
        """End this transfer group on every engine still running (a new Refitter follows an
        engine restart). An update a refit left open is finished first, with nothing loaded:
        vLLM ends no group during one, and the old weights and version stay."""

        def shutdown(engine: EngineControl) -> None:
            for path in ("/finish_weight_update", "/shutdown_weight_transfer_engine"):
                with contextlib.suppress(RefitError):
                    engine.post(path)

        self._on_all(shutdown, calls=2)
        self.close()


def set_sleeping(
    engine_urls: list[str], sleeping: bool, mode: str, timeout_s: float, token: str | None = None
) -> None:
    """vLLM sleep mode, level 1 (weights to host memory, KV cache dropped), or wake up; `mode`:
    the pause mode of requests in flight."""
    path, params = ("/sleep", {"level": 1, "mode": mode}) if sleeping else ("/wake_up", {})
    for url in engine_urls:
        EngineControl(url, timeout_s, token).post(path, **params)


def transfer_backend(cfg: RefitConfig, on_gpu: bool, colocated: bool = False) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    if not on_gpu:
        return GlooTransport.backend
    return IpcTransport.backend if colocated else NcclTransport.backend
