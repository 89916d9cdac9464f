"""Where a sharded refit gather's time goes (issue 20, item 2): `ModelWorker.named_full_tensors`
(since 37d6e01 bucketed, one all-gather per 512 MB; before, one `full_tensor()` per tensor)
against a bare loop of `full_tensor()` calls and against one all-gather of the same bytes (the
floor of any gather). Side by side in one run, on the same FSDP2-sharded model:

    python benchmarks/actor_gpu_smoke.py --write-model /tmp/q3r      # a random 1.7B shape
    PYTHONPATH=packages/molt-algos/src:packages/molt-train/src \\
      torchrun --nproc-per-node 2 benchmarks/gather_sharded.py --model /tmp/q3r

`--cpu` runs it over gloo (a CPU machine's numbers: collective overheads, not NVLink's).
Prints one JSON line from rank 0: median seconds of each over --repeats, and the ratios.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()

    from molt_train.actor_config import ActorConfig, FSDPConfig
    from molt_train.model_worker import ModelWorker

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    on_gpu = not args.cpu
    worker = ModelWorker(ActorConfig(model_path=args.model, num_workers=world), FSDPConfig(),
                         "reference", rank, world, on_gpu)  # fmt: skip
    worker.setup(args.model)
    dtype = torch.bfloat16
    state = worker.model.state_dict()
    shards = [t.to_local() if isinstance(t, DTensor) else t for t in state.values()]
    flat = torch.cat([s.detach().reshape(-1).to(dtype) for s in shards])  # this rank's bytes
    gathered = flat.new_empty(flat.numel() * world)

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()
        dist.barrier()

    def named_full_tensors() -> int:
        return sum(t.numel() for _, t in worker.named_full_tensors(gather_in=dtype))

    def bare_loop() -> int:
        return sum(t.detach().to(dtype).full_tensor().numel() for t in state.values())

    def one_collective() -> int:
        dist.all_gather_into_tensor(gathered, flat)
        return gathered.numel()

    gb = sum(t.numel() for t in state.values()) * 2 / 1e9
    results: dict = {"world": world, "tensors": len(state), "gb_bf16": gb}
    for name, fn in [("named_full_tensors", named_full_tensors), ("bare_loop", bare_loop),
                     ("one_collective", one_collective)]:  # fmt: skip
        times = []
        for _ in range(args.repeats + 1):  # the first is a warm-up
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        results[f"{name}_s"] = statistics.median(times[1:])
    results["named_vs_bare"] = results["named_full_tensors_s"] / results["bare_loop_s"]
    results["named_vs_one_collective"] = (
        results["named_full_tensors_s"] / results["one_collective_s"]
    )
    if rank == 0:
        print(json.dumps(results))
    worker.shutdown()


if __name__ == "__main__":
    main()
