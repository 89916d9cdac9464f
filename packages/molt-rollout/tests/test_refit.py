"""The refit's bucket pipeline, its order alone: the trainer packs the first bucket before the
engines pause and each next one while they load the one before, and an engine never gets a
bucket before it answered the last. And the NCCL transport's rendezvous on its bound port.
Real engines take the same loop in tests_integration/test_engines.py (CPU) and
tests_integration/gpu/test_colocated_refit.py (CUDA IPC)."""

import socket
import threading

import pytest
import torch

from molt_rollout.config import RefitConfig
from molt_rollout.refit.control import EngineSet, GlooTransport, NcclTransport, RefitError, Refitter


class Engine:
    """An engine's control routes: each bucket's load holds its reply until the trainer has
    packed the next bucket (or a second passes: no overlap)."""

    def __init__(self, packed: list[threading.Event], log: list[str]) -> None:
        self.packed, self.log, self.loading = packed, log, threading.Lock()

    def post(self, path: str, json: dict | None = None, **params) -> dict:
        if path == "/pause":
            self.log.append("pause")
        if path != "/update_weights":
            return {}
        assert self.loading.acquire(blocking=False), "a bucket arrived during a load"
        (name,) = json["update_info"]["names"]
        k = int(name)
        self.log.append(f"load {k}")
        if k + 1 < len(self.packed):
            overlapped = self.packed[k + 1].wait(timeout=1.0)
            self.log.append(f"loaded {k}" + ("" if overlapped else " alone"))
        self.loading.release()
        return {}


class Transport:
    def __init__(self, packed: list[threading.Event], log: list[str]) -> None:
        self.packed, self.log = packed, log

    def bucket_fields(self, tensors: list[torch.Tensor], index: int, dtype) -> dict:
        k = int(tensors[0][0])
        assert index == k and dtype is torch.bfloat16
        self.log.append(f"pack {k}")
        self.packed[k].set()
        return {}

    def send(self, tensors: list[torch.Tensor], dtype) -> None:
        pass


def test_the_next_bucket_is_packed_while_the_engines_load():
    buckets, log = 4, []
    packed = [threading.Event() for _ in range(buckets)]
    # one bucket each (1 MiB tensors in bf16, 1 MiB buckets), filled with its number
    named_tensors = ((str(k), torch.full((1 << 19,), float(k))) for k in range(buckets))
    refitter = Refitter.__new__(Refitter)  # its routes and transport only: no engines dialled
    engines = [Engine(packed, log), Engine(packed, log)]
    EngineSet.__init__(refitter, engines, RefitConfig(bucket_mb=1))
    refitter.transport = Transport(packed, log)
    times = refitter.refit(named_tensors, version=1, dtype=torch.bfloat16)
    refitter.close()
    assert times["refit/buckets"] == buckets
    assert not [line for line in log if line.endswith("alone")], log
    assert log.index("pack 0") < log.index("pause") < log.index("pack 1")
    for k in range(1, buckets):  # bucket k reached the engines after both answered k - 1
        assert log.index(f"pack {k}") < log.index(f"loaded {k - 1}")
        first_load = min(i for i, line in enumerate(log) if line == f"load {k}")
        assert max(i for i, line in enumerate(log) if line == f"loaded {k - 1}") < first_load


def test_the_nccl_rendezvous_listens_on_the_port_it_names(monkeypatch):
    """The trainer's store is bound when the transport is made (no port picked and bound
    later, which another process could take in between), and an engine worker joining at the
    named port meets it. NCCL's communicator itself needs CUDA: here it only keeps the group
    (the GPU tests run it)."""
    import vllm.distributed.device_communicators.pynccl as pynccl
    from vllm.distributed.utils import StatelessProcessGroup

    monkeypatch.setattr(pynccl, "PyNcclCommunicator", lambda group, device: group)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    transport = NcclTransport(2, RefitConfig(bucket_mb=1, timeout_s=30), address="127.0.0.1")
    info = transport.worker_init_info(rank_offset=1)
    with pytest.raises(OSError):  # taken: nobody else can bind it before the rendezvous
        socket.create_server(("127.0.0.1", info["master_port"]))
    joined = []
    worker = threading.Thread(
        target=lambda: joined.append(
            StatelessProcessGroup.create(
                info["master_address"], info["master_port"], rank=1, world_size=2
            )
        )
    )
    worker.start()
    transport.connect()
    worker.join(30)
    assert joined and transport.group.rank == 0 and transport.group.world_size == 2
    transport.group.broadcast_obj("weights ahead", src=0)
    assert joined[0].broadcast_obj(None, src=0) == "weights ahead"


def test_a_failed_rendezvous_on_the_trainers_side_is_an_error():
    """The engines' joins answer, but nobody joins the trainer's gloo store (the real
    transport, rank 0 of three): its timeout is raised as a RefitError, not left in a thread
    while the refitter carries on without a group."""
    refitter = Refitter.__new__(Refitter)  # its routes and transport only: no engines dialled
    EngineSet.__init__(refitter, [Engine([], []), Engine([], [])], RefitConfig(timeout_s=30))
    refitter.workers_per_engine = 1
    refitter.transport = GlooTransport(3, RefitConfig(timeout_s=1.0), "127.0.0.1")
    with pytest.raises(RefitError, match="trainer's side of the weight-transfer rendezvous"):
        refitter.init_transfer()
    refitter.close()
