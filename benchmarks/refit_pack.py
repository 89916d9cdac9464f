"""The refit's packing on one GPU: the trainer's copy of each bucket into its staging buffer.

    python benchmarks/gpu_rollout.py --write /tmp/q3r            # random Qwen3-1.7B shape
    python benchmarks/refit_pack.py --model /tmp/q3r

Every tensor of the checkpoint, in 512 MB buckets, packed into one buffer; median of 10 passes
(each synchronised). Side by side:
  bytes          each tensor copied as uint8 (Molt's `pack` before 2026-12-04)
  typed          `molt_rollout.buckets.pack`: each copied in its own dtype
  cast, bytes    fp32 master weights cast to bf16 (`.to`, a new tensor), then bytes (the refit
                 before: the trainer cast while gathering)
  cast in pack   `pack(..., dtype=bfloat16)` straight from fp32: the cast is the copy
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from molt_rollout.buckets import _layout, iter_buckets, pack, packed_size


def as_bytes(tensors: list[torch.Tensor], out: torch.Tensor) -> None:
    views = [out[o : o + n] for o, n in _layout([t.nbytes for t in tensors])]
    torch._foreach_copy_(views, [t.reshape(-1).view(torch.uint8) for t in tensors])


def median_ms(call, passes: int = 10) -> float:
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--bucket-mb", type=int, default=512)
    args = p.parse_args()
    files = sorted(args.model.glob("*.safetensors"))
    bf16 = {k: v.cuda().bfloat16() for f in files for k, v in load_file(str(f)).items()}
    fp32 = {k: v.float() for k, v in bf16.items()}
    size = args.bucket_mb << 20
    buckets = [t for _, t in iter_buckets(bf16.items(), size)]
    masters = [t for _, t in iter_buckets(fp32.items(), size, torch.bfloat16)]
    out = torch.empty(max(packed_size(b) for b in buckets), dtype=torch.uint8, device="cuda")
    bf = torch.bfloat16
    ms = {
        "bytes": median_ms(lambda: [as_bytes(b, out) for b in buckets]),
        "typed": median_ms(lambda: [pack(b, out=out) for b in buckets]),
        "cast, bytes": median_ms(lambda: [as_bytes([t.to(bf) for t in b], out) for b in masters]),
        "cast in pack": median_ms(lambda: [pack(b, out=out, dtype=bf) for b in masters]),
    }
    gb = sum(t.nbytes for t in bf16.values()) / 1e9
    for name, value in ms.items():
        print(f"{name:>13}: {value:6.2f} ms ({gb / value * 1e3:5.0f} GB/s of bf16 out)")
    print(f"pack ratio {ms['bytes'] / ms['typed']:.2f} (bytes / typed, {gb:.2f} GB)")
    print(f"pack ratio {ms['cast, bytes'] / ms['cast in pack']:.2f} (cast, bytes / cast in pack)")


if __name__ == "__main__":
    main()
