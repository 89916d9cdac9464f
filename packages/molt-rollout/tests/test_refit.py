"""The refit's bucket pipeline, its order alone: the trainer gathers and packs the next bucket
while the engines load this one, and an engine never gets a bucket before it answered the last.
Real engines take the same loop in tests_integration/test_engines.py (CPU) and
tests_integration/gpu/test_colocated_refit.py (CUDA IPC)."""

import threading

import torch

from molt_rollout.config import RefitConfig
from molt_rollout.refit import EngineSet, Refitter


class Engine:
    """An engine's control routes: each bucket's load holds its reply until the trainer has
    packed the next bucket (or a second passes: no overlap)."""

    def __init__(self, packed: list[threading.Event], log: list[str]) -> None:
        self.packed, self.log, self.loading = packed, log, threading.Lock()

    def post(self, path: str, json: dict | None = None, **params) -> dict:
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
    for k in range(1, buckets):  # bucket k reached the engines after both answered k - 1
        assert log.index(f"pack {k}") < log.index(f"loaded {k - 1}")
        first_load = min(i for i, line in enumerate(log) if line == f"load {k}")
        assert max(i for i, line in enumerate(log) if line == f"loaded {k - 1}") < first_load
