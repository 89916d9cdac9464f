"""GPU smoke test and throughput probe of the policy actor's per-rank logic, without Ray.

Runs `molt_train.model_worker.ModelWorker` under torchrun (one process per GPU, NCCL): AutoModel's
model build with FSDP2 (bf16 compute, fp32 master weights), a packed-vs-separate log-prob check
(packing must isolate sequences with the GPU attention kernels too), optimizer steps with
throughput and peak memory, the refit gather (every full tensor, bf16), and with
`--routing-replay` (a MoE model) MoE routing replay: replaying the routers' own choice changes
no log-prob, replaying other experts does, and a step trains under replay. With `--lora-rank`
the policy has LoRA adapters (AutoModel's factory adds them): only they train, and the gather
sends W + s B A under the checkpoint's names. Only torch,
transformers and NeMo AutoModel are needed (no Ray, no vLLM):

    # a random Qwen3-1.7B-shaped model (no download), then 2 GPUs
    python benchmarks/actor_gpu_smoke.py --write-model /tmp/qwen3-1.7b-random
    PYTHONPATH=packages/molt-algos/src:packages/molt-train/src \\
      torchrun --nproc-per-node 2 benchmarks/actor_gpu_smoke.py --model /tmp/qwen3-1.7b-random

    # context parallelism: one 32K-token sequence per step over two GPUs (--cp 1 for the
    # single-GPU comparison; --dump-logprobs to compare the check's log-probs across runs)
    ... torchrun --nproc-per-node 2 benchmarks/actor_gpu_smoke.py --model /tmp/qwen3-1.7b-random \\
      --cp 2 --seq-len 32768 --tokens-per-rank 32768 --max-tokens-per-microbatch 32768 \\
      --gradient-checkpointing

Prints one JSON line of results from rank 0.
"""

import argparse
import dataclasses
import json
import math
import os
import time

import numpy as np
import torch
from actor_vs_automodel import rl_algo  # the loop's loss settings (benchmarks/ is on the path)


def write_random_model(path: str, args) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    if args.moe:  # Qwen3-MoE: router `mlp.gate`, experts `mlp.experts.N.*`
        config = Qwen3MoeConfig(
            num_experts=args.experts,
            num_experts_per_tok=2,
            moe_intermediate_size=args.intermediate // 4,
            **shape,
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=args.intermediate, **shape))
    model.to(torch.bfloat16).save_pretrained(path)
    print(f"wrote {path}")


def checkpoint_names_and_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """The tensors of the checkpoint on disk: the names and shapes vLLM loads."""
    from pathlib import Path

    from safetensors import safe_open

    shapes = {}
    for file in Path(path).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})  # noqa: SIM118 (not a dict)
    return shapes


def random_samples(vocab: int, count: int, length: int, seed: int):
    from molt_train.packing import Sample

    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        n = max(8, length - 37 * (i % 5))  # mixed lengths, as rollouts are
        ids = torch.randint(0, vocab, (n,), generator=generator).tolist()
        prompt = n // 4
        mask = [0] * prompt + [1] * (n - prompt)
        advantages = [(1.0 if i % 2 else -1.0) * m for m in mask]
        samples.append(Sample(token_ids=ids, loss_mask=mask, advantages=advantages))
    return samples


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
    raw = {n: worker._full(t).float() for n, t in worker.model.state_dict().items()}
    merged = dict(worker.named_full_tensors(torch.float32))
    worst, b_max, unnamed = 0.0, 0.0, 0
    for layer, scale in worker.lora_scales.items():
        a, b = raw[f"{layer}.lora_A.weight"], raw[f"{layer}.lora_B.weight"]
        b_max = max(b_max, float(b.abs().max()))
        if f"{layer}.weight" not in merged:  # a native class renamed it for HF
            unnamed += 1
            continue
        expected = raw[f"{layer}.weight"] + scale * (b @ a)
        worst = max(worst, float((merged[f"{layer}.weight"] - expected).abs().max()))
    return {
        "lora_layers": len(worker.lora_scales),
        "lora_trainable_all_adapters": all(".lora_A." in n or ".lora_B." in n for n in trainable),
        "lora_trainable_params": len(trainable),
        "lora_B_max_abs_after_steps": b_max,
        "lora_merge_max_abs_err": worst,
        "lora_layers_not_under_their_own_name": unnamed,
        "lora_frozen_W_dtype": str(
            next(p.dtype for p in worker.model.parameters() if not p.requires_grad)
        ),  # fmt: skip
    }


def main() -> None:
    parser = argparse.ArgumentParser()
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
    args = parser.parse_args()
    if args.write_model:
        write_random_model(args.write_model, args)
        return

    import torch.distributed as dist

    from molt_train.actor_config import (
        ActorConfig,
        FSDPConfig,
        LoRAConfig,
        OptimConfig,
        validate_actor_config,
        validate_actor_devices,
    )
    from molt_train.model_worker import ModelWorker
    from molt_train.packing import plan_microbatches

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
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
    worker = ModelWorker(cfg, fsdp, args.role, rank, world, on_gpu, args.routing_replay)

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    results: dict[str, float | str] = {"world_size": world, "dtype": args.dtype}
    start = time.perf_counter()
    padded = worker.setup(args.model)
    sync()
    results["build_s"] = time.perf_counter() - start
    results["model_class"] = type(worker.model).__name__
    results["microbatch_rows"] = "padded" if padded else "packed"
    frozen = [n for n, p in worker.model.named_parameters() if not p.requires_grad]
    results["frozen_params"] = len(frozen)
    vocab = worker.model.config.vocab_size

    # 1. Microbatch rows isolate sequences: several per microbatch == one per microbatch.
    check = random_samples(vocab, 4, 300, seed=1)
    packed = worker.forward_logprobs([check])[0]
    alone = [worker.forward_logprobs([[s]])[0][0] for s in check]
    diff = max(
        abs(a - b) for p, q in zip(packed, alone, strict=True) for a, b in zip(p, q, strict=True)
    )
    results["packed_vs_alone_max_abs_diff"] = diff
    if args.dump_logprobs and rank == 0:  # to compare runs (e.g. --cp 2 against --cp 1)
        with open(args.dump_logprobs, "w") as f:
            json.dump(packed, f)

    # 2. Optimizer steps over this rank's share of a batch (same plan on every rank).
    replicas = args.tp * args.cp  # ranks that share one data-parallel share
    dp = world // replicas
    count = args.tokens_per_rank * dp // args.seq_len
    samples = random_samples(vocab, count, args.seq_len, seed=2)
    plan = plan_microbatches(samples, args.max_tokens_per_microbatch, dp, padded)
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
    results["step_s"] = step_times
    results["tokens_per_s_per_gpu"] = tokens / world / min(step_times)
    keys = (
        "loss/policy",
        "loss/value",
        "train/grad_norm",
        "loss/entropy",
        "loss/approx_kl",
        "perf/peak_memory_gb",
    )
    results.update({k: metrics[k] for k in keys if k in metrics})

    # 3. The refit gather: every full tensor, bf16, on every rank.
    sync()
    start = time.perf_counter()
    shapes = {n: tuple(t.shape) for n, t in worker.named_full_tensors(torch.bfloat16)}
    sync()
    results["refit_gather_s"] = time.perf_counter() - start
    dtype_bytes = torch.tensor([], dtype=torch.bfloat16).element_size()
    results["refit_gather_gb"] = sum(math.prod(v) for v in shapes.values()) * dtype_bytes / 1e9
    if args.role == "policy":  # what vLLM will be sent: the checkpoint's names and shapes
        expected = checkpoint_names_and_shapes(args.model)
        results["refit_names_match_hf"] = shapes == expected
        if shapes != expected:
            results["refit_name_diff"] = sorted(set(shapes) ^ set(expected))[:8]
    if args.lora_rank:
        results.update(lora_check(worker))
    # 4. MoE routing replay.
    if args.routing_replay:
        experts = getattr(worker.model.config, "num_experts", None) or args.experts
        results.update(routing_replay_check(worker, vocab, experts))
    if rank == 0:
        print(json.dumps(results))
    dist.barrier()
    worker.shutdown()


if __name__ == "__main__":
    main()
