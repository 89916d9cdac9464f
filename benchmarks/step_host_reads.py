"""Where one RL training step reads device values back on the host, by caller, on CPU.

On a GPU each such read (`.item()`, `.tolist()`, `float(t)`, `if t:`, `nonzero`, boolean-mask
indexing) makes the host wait for the GPU's queue; in the middle of a step that leaves the GPU
idle while the host launches what comes next. The GPU profile counts the waits
(`actor_vs_automodel.py --sections profile`) but its runtime events carry no Python stack; this
runs the same `ModelWorker.train_step` on CPU with the GPU's layout (packed rows, document
attention) and lists every read with its three innermost non-torch frames:

    python benchmarks/actor_vs_automodel.py --write-model /tmp/tiny --cpu
    PYTHONPATH=packages/molt-algos/src:packages/molt-train/src:benchmarks \\
      python benchmarks/step_host_reads.py /tmp/tiny

A read on a CPU-resident tensor (Adam's step counts, a device mesh) costs nothing on the GPU
either; the GPU-only paths (AutoModel's Triton gradient norm, compiled log-prob blocks) do not
run here. docs/benchmarks.md, "The step ratio on one H100", says what it found.
"""

import os
import sys
import traceback
from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READ_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2")
READS: Counter = Counter()


def caller() -> str:
    frames = [f for f in traceback.extract_stack()[:-2]
              if "/torch/" not in f.filename and f.filename != __file__]  # fmt: skip
    return " < ".join(f"{f.filename.rsplit('/src/', 1)[-1].rsplit('site-packages/', 1)[-1]}:"
                      f"{f.lineno} {f.name}" for f in frames[::-1][:3])  # fmt: skip


class HostReads(TorchDispatchMode):
    """Counts the ops that need a device value on the host (item, nonzero, masked_select)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in READ_OPS:
            READS[(func._schema.name, caller())] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_tolist():
    """`.tolist()` copies without dispatching an op: count it at the method."""
    original = torch.Tensor.tolist

    def tolist(self):
        READS[("Tensor.tolist", caller())] += 1
        return original(self)

    torch.Tensor.tolist = tolist
    try:
        yield
    finally:
        torch.Tensor.tolist = original


def main() -> None:
    from actor_gpu_smoke import random_samples
    from actor_levers import rl_algo

    from molt_train.actor_config import ActorConfig, FSDPConfig, OptimConfig
    from molt_train.attention import enable_document_attention
    from molt_train.model_worker import ModelWorker
    from molt_train.packing import plan_microbatches

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0",
                           WORLD_SIZE="1", LOCAL_RANK="0").items():  # fmt: skip
        os.environ.setdefault(key, value)
    model = sys.argv[1]
    cfg = ActorConfig(model_path=model, num_workers=1, dtype="bf16",
                      max_tokens_per_microbatch=256, optim=OptimConfig(lr=1e-6))  # fmt: skip
    worker = ModelWorker(cfg, FSDPConfig(), "policy", 0, 1, False)
    worker.setup(model)
    worker.padded = False  # the GPU's layout: packed rows through the document attention
    enable_document_attention(worker.model)
    samples = random_samples(worker.model.config.vocab_size, 4, 128, seed=1)
    plan = plan_microbatches(samples, 512, 1, worker.padded)
    microbatches = [[samples[i] for i in mb] for mb in plan[0]]
    for mb, values in zip(microbatches, worker.forward_logprobs(microbatches), strict=True):
        for sample, logprobs in zip(mb, values, strict=True):
            sample.old_logprobs = logprobs
    tokens = sum(s.num_trained for s in samples)
    sequences = sum(1 for s in samples if s.num_trained)
    worker.train_step(microbatches, tokens, sequences, rl_algo())  # warm-up
    with HostReads(), counting_tolist():
        worker.train_step(microbatches, tokens, sequences, rl_algo())
    print(f"host reads in one train_step ({len(microbatches)} microbatch, packed rows):")
    for (op, where), n in READS.most_common():
        print(f"{n:4d}  {op:28s} {where}")
    worker.shutdown()


if __name__ == "__main__":
    main()
