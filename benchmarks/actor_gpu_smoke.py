"""The trainer's per-rank logic on GPUs, without Ray: a check of every parallel layout, with its
throughput (no baseline: trainer_vs_automodel.py compares the step with AutoModel's).

Runs `molt_train.model_worker.ModelWorker` under torchrun (one process per GPU, NCCL): AutoModel's
model build with FSDP2 (bf16 compute, fp32 master weights), a packed-vs-separate log-prob check
(packing must isolate sequences with the GPU attention kernels too), optimizer steps with
throughput and peak memory, the refit gather (every full tensor, bf16, under the checkpoint's
names), and with `--routing-replay` (a MoE model) MoE routing replay: replaying the routers' own
choice changes no log-prob, replaying other experts does, and a step trains under replay. With
`--lora-rank` the policy has LoRA adapters (AutoModel's factory adds them): only they train, and
the gather sends W + s B A under the checkpoint's names.

    # a random Qwen3-1.7B-shaped model (no download; --moe: a Qwen3-MoE), then 2 GPUs
    python benchmarks/actor_gpu_smoke.py --write-model /tmp/qwen3-1.7b-random
    torchrun --nproc-per-node 2 benchmarks/actor_gpu_smoke.py --model /tmp/qwen3-1.7b-random

    # context parallelism: one 32K-token sequence per step over two GPUs (--cp 1 for the
    # single-GPU comparison; --dump-logprobs to compare the check's log-probs across runs)
    torchrun --nproc-per-node 2 benchmarks/actor_gpu_smoke.py --model /tmp/qwen3-1.7b-random \\
      --cp 2 --seq-len 32768 --tokens-per-rank 32768 --max-tokens-per-microbatch 32768 \\
      --gradient-checkpointing

Prints one JSON line of results from rank 0. tests_integration/gpu/test_two_gpus.py runs it.
"""

import argparse
import dataclasses
import json
import math
import os
import time

import numpy as np
import torch
from trainer_inputs import random_samples, rl_algo, write_random_model


def checkpoint_names_and_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """The tensors of the checkpoint on disk: the names and shapes vLLM loads."""
    from pathlib import Path

    from safetensors import safe_open

    shapes = {}
    for file in Path(path).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names = f.keys()  # a safetensors handle, not a dict: no iterating it
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in names})
    return shapes


def own_routing(worker, sample) -> np.ndarray:
    """[tokens, layers, top_k] the worker's routers pick for `sample` by themselves (-1 in
    dense layers): AutoModel's gates record through their RouterReplay handle, transformers'
    routers through a hook on their output."""
    from nemo_automodel.components.moe.router_replay import RouterReplayMode

    picked, hooks = {}, []
    for layer, router in worker.routers:
        if getattr(router, "router_replay", None) is not None:
            router.router_replay.mode = RouterReplayMode.RECORD
        else:
            record = lambda m, i, out, layer=layer: picked.update({layer: out[2]})  # noqa: E731
            hooks.append(router.register_forward_hook(record))
    worker.forward_logprobs([[sample]])
    for layer, router in worker.routers:
        if getattr(router, "router_replay", None) is not None:
            picked[layer] = router.router_replay.recorded_indices
            router.router_replay.mode = None
    for hook in hooks:
        hook.remove()
    n, top_k = len(sample.token_ids), next(iter(picked.values())).shape[-1]
    routing = np.full((n, worker.model.config.num_hidden_layers, top_k), -1, dtype=np.int16)
    for layer, indices in picked.items():
        routing[:, layer] = indices[:n].cpu().numpy()
    return routing


def routing_replay_check(worker, vocab: int, experts: int) -> dict:
    sample = random_samples(vocab, 1, 300, seed=3)[0]
    plain = np.array(worker.forward_logprobs([[sample]])[0][0])
    own = own_routing(worker, sample)
    other = np.where(own >= 0, (own + 1) % experts, own).astype(np.int16)  # still distinct

    def replayed(routing) -> np.ndarray:
        with_routing = dataclasses.replace(sample, routed_experts=routing)
        return np.array(worker.forward_logprobs([[with_routing]])[0][0])

    results = {
        "replay_routers": len(worker.routers),
        "replay_own_max_abs_diff": float(np.abs(replayed(own) - plain).max()),
        "replay_other_max_abs_diff": float(np.abs(replayed(other) - plain).max()),
    }
    with_routing = dataclasses.replace(sample, routed_experts=own, old_logprobs=plain.tolist())
    step = worker.train_step([[with_routing]], with_routing.num_trained, 1, rl_algo())
    return {**results, "replay_step_grad_norm": step["train/grad_norm"]}


def lora_check(worker) -> dict:
    """Only adapters train; each merged weight (fp32 gather) equals W + s B A of the gathered
    raw tensors."""
    trainable = [n for n, p in worker.model.named_parameters() if p.requires_grad]
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.to(worker.device).full_tensor() if isinstance(t, DTensor) else t

    raw = {n: full(t).float() for n, t in worker.model.state_dict().items()}
    merged = dict(worker.weights.named_full_tensors(torch.float32))
    worst, b_max, unnamed = 0.0, 0.0, 0
    for layer, scale in worker.weights.lora_scales.items():
        a, b = raw[f"{layer}.lora_A.weight"], raw[f"{layer}.lora_B.weight"]
        b_max = max(b_max, float(b.abs().max()))
        if f"{layer}.weight" not in merged:  # a native class renamed it for HF
            unnamed += 1
            continue
        expected = raw[f"{layer}.weight"] + scale * (b @ a)
        worst = max(worst, float((merged[f"{layer}.weight"] - expected).abs().max()))
    return {
        "lora_layers": len(worker.weights.lora_scales),
        "lora_trainable_all_adapters": all(".lora_A." in n or ".lora_B." in n for n in trainable),
        "lora_trainable_params": len(trainable),
        "lora_B_max_abs_after_steps": b_max,
        "lora_merge_max_abs_err": worst,
        "lora_layers_not_under_their_own_name": unnamed,
        "lora_frozen_W_dtype": str(
            next(p.dtype for p in worker.model.parameters() if not p.requires_grad)
        ),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF directory to train")
    parser.add_argument("--write-model", help="write a random model here and exit")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=6144)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--tokens-per-rank", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1, help="context parallel ranks")
    parser.add_argument("--dump-logprobs", help="write check 1's log-probs here (rank 0, JSON)")
    parser.add_argument("--offload", default="none")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--moe", action="store_true", help="--write-model: a Qwen3-MoE")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--freeze-moe-router", action="store_true")
    parser.add_argument("--routing-replay", action="store_true", help="check MoE routing replay")
    parser.add_argument("--role", default="policy", choices=["policy", "critic"])
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA on every projection")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU: checks the script only")
    return parser.parse_args()


def build_worker(args, rank: int, world: int):
    from molt_train.actor_config import (
        ActorConfig,
        FSDPConfig,
        LoRAConfig,
        OptimConfig,
        validate_actor_config,
        validate_actor_devices,
    )
    from molt_train.model_worker import ModelWorker

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    cfg = ActorConfig(
        model_path=args.model,
        num_workers=world,
        dtype=args.dtype,
        max_tokens_per_microbatch=args.max_tokens_per_microbatch,
        gradient_checkpointing=args.gradient_checkpointing,
        freeze_moe_router=args.freeze_moe_router,
        # LoRA's B starts at zero: a larger step makes the merge visible in bf16.
        optim=OptimConfig(lr=1e-4 if args.lora_rank else 1e-6),
        lora=LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank),
    )
    fsdp = FSDPConfig(tp_size=args.tp, cp_size=args.cp, ep_size=args.ep, offload=args.offload)
    on_gpu = not args.cpu
    gpus = torch.cuda.device_count() * int(os.environ.get("NNODES", 1)) if on_gpu else 0
    validate_actor_config(cfg, fsdp)
    validate_actor_devices(cfg, fsdp, gpus)
    return ModelWorker(cfg, fsdp, args.role, rank, world, on_gpu, args.routing_replay)


def packed_check(worker, args, rank: int) -> dict:
    """1. Microbatch rows isolate sequences: several per microbatch == one per microbatch."""
    check = random_samples(worker.model.config.vocab_size, 4, 300, seed=1)
    packed = worker.forward_logprobs([check])[0]
    alone = [worker.forward_logprobs([[s]])[0][0] for s in check]
    pairs = zip(packed, alone, strict=True)
    diff = float(max(abs(a - b) for p, q in pairs for a, b in zip(p, q, strict=True)))
    if args.dump_logprobs and rank == 0:  # to compare runs (e.g. --cp 2 against --cp 1)
        with open(args.dump_logprobs, "w") as f:
            json.dump([np.asarray(values, dtype=float).tolist() for values in packed], f)
    return {"packed_vs_alone_max_abs_diff": diff}


def train_steps(worker, args, rank: int, world: int, sync) -> dict:
    """2. Optimizer steps over this rank's share of a batch (the same plan on every rank)."""
    from molt_train.packing import plan_microbatches

    replicas = args.tp * args.cp  # ranks that share one data-parallel share
    dp = world // replicas
    count = args.tokens_per_rank * dp // args.seq_len
    samples = random_samples(worker.model.config.vocab_size, count, args.seq_len, seed=2)
    plan = plan_microbatches(samples, args.max_tokens_per_microbatch, dp, worker.padded)
    mine = [[samples[i] for i in mb] for mb in plan[rank // replicas]]
    for mb, values in zip(mine, worker.forward_logprobs(mine), strict=True):
        for sample, old in zip(mb, values, strict=True):
            sample.old_logprobs = old
            sample.returns, sample.old_values = sample.advantages, old  # read by a critic
    num_tokens = sum(s.num_trained for s in samples)
    num_sequences = sum(1 for s in samples if s.num_trained)
    step_times = []
    for _ in range(args.steps):
        sync()
        start = time.perf_counter()
        metrics = worker.train_step(mine, num_tokens, num_sequences, rl_algo())
        sync()
        step_times.append(time.perf_counter() - start)
    tokens = sum(len(s.token_ids) for s in samples)
    results = {"step_s": step_times, "tokens_per_s_per_gpu": tokens / world / min(step_times)}
    keys = ("loss/policy", "loss/value", "train/grad_norm", "loss/entropy", "loss/approx_kl")
    return results | {k: metrics[k] for k in (*keys, "perf/peak_memory_gb") if k in metrics}


def gather_check(worker, args, sync) -> dict:
    """3. The refit gather: every full tensor, bf16, on every rank, under the checkpoint's
    names and shapes (what vLLM will be sent)."""
    sync()
    start = time.perf_counter()
    shapes = {n: tuple(t.shape) for n, t in worker.weights.named_full_tensors(torch.bfloat16)}
    sync()
    results = {"refit_gather_s": time.perf_counter() - start}
    results["refit_gather_gb"] = sum(math.prod(v) for v in shapes.values()) * 2 / 1e9
    if args.role == "policy":
        expected = checkpoint_names_and_shapes(args.model)
        results["refit_names_match_hf"] = shapes == expected
        if shapes != expected:
            results["refit_name_diff"] = sorted(set(shapes) ^ set(expected))[:8]
    return results


def main() -> None:
    args = parse_args()
    if args.write_model:
        shape = dict(vocab=args.vocab, hidden=args.hidden, intermediate=args.intermediate)
        shape.update(layers=args.layers, heads=args.heads, kv_heads=args.kv_heads)
        write_random_model(args.write_model, **shape, experts=args.experts if args.moe else 0)
        return
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    worker = build_worker(args, rank, world)

    def sync() -> None:
        if not args.cpu:
            torch.cuda.synchronize()

    results: dict = {"world_size": world, "dtype": args.dtype}
    start = time.perf_counter()
    worker.setup(args.model)
    sync()
    results["build_s"] = time.perf_counter() - start
    results["model_class"] = type(worker.model).__name__
    results["microbatch_rows"] = "padded" if worker.padded else "packed"
    frozen = [n for n, p in worker.model.named_parameters() if not p.requires_grad]
    results["frozen_params"] = len(frozen)
    results |= packed_check(worker, args, rank)
    results |= train_steps(worker, args, rank, world, sync)
    results |= gather_check(worker, args, sync)
    if args.lora_rank:
        results |= lora_check(worker)
    if args.routing_replay:  # 4. MoE routing replay
        experts = getattr(worker.model.config, "num_experts", None) or args.experts
        results |= routing_replay_check(worker, worker.model.config.vocab_size, experts)
    if rank == 0:
        print(json.dumps(results, default=float))  # numpy scalars too
    dist.barrier()
    worker.shutdown()


if __name__ == "__main__":
    main()
