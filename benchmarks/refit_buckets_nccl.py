"""Refit wire throughput on GPU: Molt's bucketed transfer over NCCL vs one raw broadcast.

    torchrun --nproc-per-node 2 benchmarks/refit_buckets_nccl.py --bucket-mb 64 256 512 1024

Rank 0 plays the trainer: a Qwen3-1.7B-shaped bf16 state dict (random) on its GPU, grouped
with molt_rollout.buckets.iter_buckets, packed, and broadcast bucket by bucket. Rank 1 plays
an engine worker: it receives each bucket into a fresh buffer and unpacks it (views). Checked:
the received state dict is bit-identical. Compared, in the same run: one broadcast of a single
buffer of the same total size (the link's ceiling). vLLM itself does not run here (it cannot
be installed on these machines), so the engine-side load_weights is not timed. Without a GPU
the script runs over gloo on CPU (a smoke test: `--layers 2 --vocab 1000`).
"""

import argparse
import importlib.util
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

# buckets.py needs torch alone; load it by path so a GPU machine without molt-rollout's other
# dependencies (vLLM, Ray, fastapi) runs this script as it is.
_path = Path(__file__).parents[1] / "packages/molt-rollout/src/molt_rollout/buckets.py"
_spec = importlib.util.spec_from_file_location("molt_buckets", _path)
buckets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(buckets)
iter_buckets, pack, unpack = buckets.iter_buckets, buckets.pack, buckets.unpack

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def qwen3_state_dict(
    layers, vocab, hidden=2048, intermediate=6144, heads=16, kv_heads=8, head_dim=128
):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (intermediate, hidden),
            p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return {
        name: torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.bfloat16)
        for name, shape in shapes.items()
    }


def bucketed(state, bucket_bytes, rank, metas):
    """One refit: rank 0 packs and sends each bucket; rank 1 receives and unpacks."""
    received = {}
    source = iter_buckets(state.items(), bucket_bytes) if rank == 0 else metas
    for meta, tensors in source:
        if rank == 0:
            buffer = pack(tensors)
        else:
            buffer = torch.empty(meta.numbytes(), dtype=torch.uint8, device=DEVICE)
        dist.broadcast(buffer, 0)
        if rank == 1:
            received.update(unpack(buffer, meta))
    sync()
    return received


def best_time(fn, repeats):
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times), result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[64, 256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    rank = dist.get_rank()
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    state = qwen3_state_dict(args.layers, args.vocab)
    total = sum(t.numel() * t.element_size() for t in state.values())

    raw = torch.empty(total, dtype=torch.uint8, device=DEVICE)
    dist.broadcast(raw, 0)  # warm-up
    rows = [("one raw broadcast", best_time(lambda: dist.broadcast(raw, 0), args.repeats)[0])]
    for mb in args.bucket_mb:
        metas = [(meta, None) for meta, _ in iter_buckets(state.items(), mb << 20)]
        bucketed(state, mb << 20, rank, metas)  # warm-up
        seconds, received = best_time(
            lambda mb=mb, metas=metas: bucketed(state, mb << 20, rank, metas), args.repeats
        )
        if rank == 1:
            assert received.keys() == state.keys()
            assert all(torch.equal(received[k], state[k]) for k in state), "received weights differ"
        rows.append((f"buckets of {mb} MiB ({len(metas)} calls)", seconds))

    if rank == 0:
        print(f"\n{total / 1e9:.2f} GB of bf16 weights (Qwen3-1.7B shape, {args.layers} layers), "
              f"2 ranks, {dist.get_backend()}, best of {args.repeats}")  # fmt: skip
        print("| transfer | seconds | GB/s | time vs one raw broadcast |")
        print("|---|---|---|---|")
        for name, seconds in rows:
            print(
                f"| {name} | {seconds:.4f} | {total / seconds / 1e9:.0f} | {seconds / rows[0][1]:.2f}x |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
