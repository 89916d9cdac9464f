"""The RL policy step against a bare NeMo AutoModel step: one checkpoint, the same tokens.

    python benchmarks/trainer_vs_automodel.py --write-model /tmp/q3    # random Qwen3-1.7B shape
    torchrun --nproc-per-node 1 benchmarks/trainer_vs_automodel.py --model /tmp/q3 --out DIR

Both start from the same checkpoint and train on the same packed microbatches, alternating step
by step:
  rl    `ModelWorker.train_step` as `molt-train` runs it (PPO, token-mean: the worker's
        attention, dtype policy and chunked log-probs);
  bare  AutoModel as it comes: fp32 parameters under bf16 autocast, the same packed rows with
        restarting position ids, the model's own cross-entropy over fp32 logits, gradient
        clipping, AdamW.
At --nproc-per-node 2 the bare model is sharded as the worker's is (FSDP2 over the same mesh).
On a card that cannot hold both models' steps (80 GB at the 1.7B shape), `--resident one` runs
the RL side, frees its model, then builds the bare one and runs it on the same tokens; the
ratios are joined. `--cpu` on a tiny model (`--write-model DIR --cpu`) checks the script
without a GPU.

Printed (rank 0) per sequence length (--seq-lens) and entropy coefficient (--entropy-coefs):
step time (median of --steps after --warmup), tokens/s per GPU, MFU, peak memory above what the
step started with, and the step ratio: RL tokens/s over bare tokens/s. Per sequence length, the
forward-only pass (the worker's old-policy or reference log-probs) against a bare forward.
`--sections gather`: the refit gather (`ModelWorker.named_full_tensors`, bf16) against a bare
loop over the state dict. `--sections profile` (GPU): one step and one forward of each under
torch.profiler: GPU busy and idle time, kernels launched, the top kernels (full tables in
--out). Every ratio is the bare time over Molt's: above 1, Molt is faster. Raw results:
DIR/results.json.

MFU: model FLOPs / (seconds x 989.4e12, the H100 and H200 SXM dense bf16 rate by datasheet):
  FLOPs(step)    = 6 N T + 6 L h d sum_i s_i^2
  FLOPs(forward) = 2 N T + 2 L h d sum_i s_i^2
N = parameters without the input embedding (lm_head counted), T = tokens, L = layers, h = query
heads, d = head size, s_i = each document's length (causal attention within a document). Work
beyond that (a dense block mask's whole T x T square, the log-prob backward's recomputed LM-head
matmul) is not counted.
"""

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from trainer_inputs import QWEN3_1_7B, TINY, random_samples, rl_algo, write_random_model

PEAK_FLOPS = 989.4e12
SECTIONS = ("main", "gather", "profile")
RANK = int(os.environ.get("RANK", 0))


def say(*parts) -> None:
    if RANK == 0:
        print(*parts, flush=True)


def timed_call(fn, on_gpu: bool) -> tuple[float, float, object]:
    """(seconds, peak GB above what was allocated before, result) of one call."""
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    result = fn()
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if on_gpu else 0.0
    return seconds, peak, result


def model_numbers(model) -> dict:
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    heads, layers = cfg.num_attention_heads, cfg.num_hidden_layers
    return dict(N=total - embed, total=total, L=layers, hd=heads * head_dim, vocab=cfg.vocab_size)


def flops(nums: dict, lengths: list[int], backward: bool) -> float:
    k = 6 if backward else 2
    return k * nums["N"] * sum(lengths) + k * nums["L"] * nums["hd"] * sum(s * s for s in lengths)


class Bare:
    """AutoModel as it comes: forward with labels (its own cross-entropy over fp32 logits),
    backward, gradient clipping, AdamW; bf16 autocast over its fp32 parameters on GPU."""

    def __init__(self, model, on_gpu: bool):
        self.model, self.on_gpu = model, on_gpu
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)

    def step(self, microbatches: list[dict]) -> None:
        self.model.train()
        for mb in microbatches:
            with torch.autocast("cuda", torch.bfloat16, enabled=self.on_gpu):
                loss = self.model(**mb, use_cache=False).loss
            (loss / len(microbatches)).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def forward(self, microbatches: list[dict]) -> None:
        self.model.eval()
        for mb in microbatches:
            with torch.autocast("cuda", torch.bfloat16, enabled=self.on_gpu):
                inputs = {k: mb[k] for k in ("input_ids", "position_ids")}
                self.model(**inputs, use_cache=False)


@dataclass
class Inputs:
    """One sequence length's tokens: the worker's microbatches and the bare model's view of
    them (one packed row each, position ids restarting per document, labels -100 off the loss
    mask so no target crosses a document border)."""

    microbatches: list
    bare: list[dict]
    lengths: list[int]
    num_tokens: int
    num_sequences: int


def make_inputs(args, worker, vocab: int, seq_len: int) -> Inputs:
    from molt_train.packing import plan_microbatches

    count = max(1, args.tokens_per_step // seq_len)
    samples = random_samples(vocab, count, seq_len, seed=seq_len, trained=args.trained_share)
    plan = plan_microbatches(samples, args.max_tokens_per_microbatch, 1, worker.padded)
    microbatches = [[samples[i] for i in mb] for mb in plan[0]]
    bare = []
    for mb in microbatches:
        ids = [t for s in mb for t in s.token_ids]
        positions = [i for s in mb for i in range(len(s.token_ids))]
        labels = [
            t if m else -100 for s in mb for t, m in zip(s.token_ids, s.loss_mask, strict=True)
        ]
        row = dict(input_ids=ids, position_ids=positions, labels=labels)
        bare.append({k: torch.tensor([v], device=worker.device) for k, v in row.items()})
    return Inputs(
        microbatches,
        bare,
        [len(s.token_ids) for s in samples],
        sum(s.num_trained for s in samples),
        sum(1 for s in samples if s.num_trained),
    )


class Benchmark:
    """The measurements of one run: rows of results, each side's inputs kept per sequence
    length so that both phases of `--resident one` see the same tokens."""

    def __init__(self, args, worker, on_gpu: bool):
        self.args, self.worker, self.on_gpu = args, worker, on_gpu
        self.nums = model_numbers(worker.model)
        self.inputs: dict[int, Inputs] = {}
        self.bare: Bare | None = None
        self.results: dict = dict(
            model=self.nums,
            device=torch.cuda.get_device_name() if on_gpu else "cpu",
            torch=torch.__version__,
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            args=vars(args),
            rows=[],
        )
        self.out = None
        if RANK == 0:
            self.out = Path(args.out or tempfile.mkdtemp(prefix="trainer_vs_automodel-"))
            self.out.mkdir(parents=True, exist_ok=True)
            say(f"raw results in {self.out}")

    def inputs_for(self, seq_len: int) -> Inputs:
        if seq_len not in self.inputs:
            vocab = self.nums["vocab"]
            self.inputs[seq_len] = make_inputs(self.args, self.worker, vocab, seq_len)
        return self.inputs[seq_len]

    def timed(self, calls: dict) -> dict[str, tuple]:
        """(median seconds, largest peak GB, last result) of each call over --steps after
        --warmup, the calls alternating."""
        times: dict[str, list[float]] = {name: [] for name in calls}
        peaks, results = dict.fromkeys(calls, 0.0), {}
        for i in range(self.args.warmup + self.args.steps):
            for name, fn in calls.items():
                seconds, peak, results[name] = timed_call(fn, self.on_gpu)
                if i >= self.args.warmup:
                    times[name].append(seconds)
                    peaks[name] = max(peaks[name], peak)
        return {
            name: (statistics.median(times[name]), peaks[name], results[name]) for name in calls
        }

    def calls(self, sides: set[str], inputs: Inputs, entropy_coef: float | None) -> dict:
        """Each resident side's step on `inputs`, or its forward-only pass (coefficient None)."""
        calls = {}
        if "rl" in sides and entropy_coef is None:
            calls["rl-fwd"] = partial(self.worker.forward_logprobs, inputs.microbatches)
        elif "rl" in sides:
            algo = rl_algo(entropy_coef)
            calls["rl"] = partial(
                self.worker.train_step,
                inputs.microbatches,
                inputs.num_tokens,
                inputs.num_sequences,
                algo,
            )
        if "bare" in sides:
            forward = entropy_coef is None
            calls["bare-fwd" if forward else "bare"] = partial(
                self.bare.forward if forward else self.bare.step, inputs.bare
            )
        return calls

    def add_rows(self, setting: str, entropy: str, measured: dict, backward: bool, lengths):
        """Rows of one group (a setting's steps or its forward passes); each row's ratio to the
        group's bare row, once both are in (in one phase, or across the two of --resident one)."""
        work = flops(self.nums, lengths, backward)
        for variant, (seconds, peak, _) in measured.items():
            row = dict(setting=setting, entropy=entropy, variant=variant, s=seconds)
            row.update(tok_s=sum(lengths) / seconds, mfu=work / seconds / PEAK_FLOPS, peak_gb=peak)
            self.results["rows"].append(row)
            label = f"[{setting}]" if entropy == "-" else f"[{setting} entropy {entropy}]"
            say(
                f"{label} {variant} {seconds:.3f} s {row['tok_s']:.0f} tok/s "
                f"MFU {row['mfu']:.1%} peak +{peak:.1f} GB"
            )
        group = [r for r in self.results["rows"] if r["setting"] == setting]
        group = [r for r in group if r["entropy"] == entropy]
        base = next((r for r in group if r["variant"].startswith("bare")), None)
        for row in group if base else []:
            row["ratio"] = row["tok_s"] / base["tok_s"]

    def main(self, sides: set[str]) -> None:
        """Each sequence length's forward-only passes, then its steps per entropy setting."""
        for seq_len in self.args.seq_lens:
            inputs = self.inputs_for(seq_len)
            measured = self.timed(self.calls(sides, inputs, None))
            self.add_rows(str(seq_len), "-", measured, False, inputs.lengths)
            old = measured["rl-fwd"][2] if "rl" in sides else []
            for mb, values in zip(inputs.microbatches, old, strict=True) if old else []:
                for sample, logprobs in zip(mb, values, strict=True):
                    sample.old_logprobs = logprobs  # the RL step's old policy
            for coef in self.args.entropy_coefs:
                measured = self.timed(self.calls(sides, inputs, coef))
                self.add_rows(str(seq_len), "on" if coef else "off", measured, True, inputs.lengths)
            self.dump()

    def gather(self) -> None:
        """The refit gather against a bare loop that casts each tensor and gathers it."""
        from torch.distributed.tensor import DTensor

        model = self.worker.model

        def full(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

        def worker_gather() -> int:
            tensors = self.worker.weights.named_full_tensors(torch.bfloat16)
            return sum(t.numel() for _, t in tensors)

        def bare_loop() -> int:
            tensors = model.state_dict().values()
            return sum(full(v.detach().to(torch.bfloat16)).numel() for v in tensors)

        measured = self.timed({"named_full_tensors": worker_gather, "bare_loop": bare_loop})
        ours, bare = measured["named_full_tensors"][0], measured["bare_loop"][0]
        gb = sum(full(v).numel() for v in model.state_dict().values()) * 2 / 1e9
        self.results["gather"] = dict(named_full_tensors_s=ours, bare_loop_s=bare, gb_bf16=gb)
        say(
            f"gather ratio {bare / ours:.2f} (bare loop {bare:.3f} s, ours {ours:.3f} s, "
            f"{gb:.2f} GB)"
        )

    def profile(self, sides: set[str]) -> None:
        """One step and one forward-only pass of each resident side at --default-seq-len under
        torch.profiler."""
        from torch.profiler import ProfilerActivity, profile

        inputs = self.inputs_for(self.args.default_seq_len)
        calls = {**self.calls(sides, inputs, 0.0), **self.calls(sides, inputs, None)}
        for name, fn in calls.items():
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                wall = time.perf_counter() - start
            busy = gpu_busy_seconds(prof)
            events = prof.key_averages()
            kernels = [
                e
                for e in events
                if str(e.device_type).endswith("CUDA")
                and e.self_device_time_total > 0
                and "#" not in e.key
                and not e.key.startswith("ProfilerStep")
            ]
            top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:10]
            self.results.setdefault("profile", {})[name] = dict(
                wall_s=wall,
                gpu_busy_s=busy,
                kernels_launched=sum(e.count for e in kernels),
                top=[(e.key[:90], e.count, e.self_device_time_total / 1e3) for e in top],
            )
            if self.out:
                table = events.table(sort_by="self_device_time_total", row_limit=30)
                (self.out / f"profile_{name}.txt").write_text(table)
            say(
                f"profile {name}: wall {wall:.3f} s, GPU busy {busy:.3f} s, idle "
                f"{wall - busy:.3f} s, {sum(e.count for e in kernels)} kernels"
            )
            for e in top:
                say(f"   {e.self_device_time_total / 1e3:9.2f} ms  x{e.count:<5d} {e.key[:90]}")

    def summary(self) -> None:
        """The step ratio per setting, the forward-only ratio per sequence length, and the
        default setting's step ratio last."""
        rows = {(r["setting"], r["entropy"], r["variant"]): r for r in self.results["rows"]}
        for (setting, entropy, variant), row in sorted(rows.items()):
            if variant == "rl" and "ratio" in row:
                bare = rows[setting, entropy, "bare"]["s"]
                say(
                    f"[{setting} entropy {entropy}] step ratio {row['ratio']:.2f} "
                    f"(rl {row['s']:.3f} s, bare {bare:.3f} s)"
                )
            if variant == "rl-fwd" and "ratio" in row:
                say(f"[{setting}] forward-only ratio {row['ratio']:.2f}")
        default = rows.get((str(self.args.default_seq_len), "off", "rl"), {})
        if "ratio" in default:
            say(f"step ratio {default['ratio']:.2f}")

    def dump(self) -> None:
        if self.out:
            text = json.dumps(self.results, indent=1, default=str)
            (self.out / "results.json").write_text(text)


def gpu_busy_seconds(prof) -> float:
    """The union of the device's event intervals (kernels, copies, sets), annotations out."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if str(getattr(e, "device_type", "")).endswith("CUDA")
        and not getattr(e, "is_user_annotation", False)
        and "#" not in e.name[:40]
        and not e.name.startswith(("Optimizer.", "ProfilerStep"))
    )
    busy, start, end = 0.0, None, None
    for a, b in spans:
        if end is None or a > end:
            busy += 0.0 if end is None else end - start
            start, end = a, b
        else:
            end = max(end, b)
    return (busy + (0.0 if end is None else end - start)) / 1e6


def build_worker(args, on_gpu: bool, rank: int, world: int):
    from molt_train.actor_config import ActorConfig, FSDPConfig, OptimConfig
    from molt_train.model_worker import ModelWorker

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    cfg = ActorConfig(
        model_path=args.model,
        num_workers=world,
        dtype="bf16",
        max_tokens_per_microbatch=args.max_tokens_per_microbatch,
        optim=OptimConfig(lr=1e-6),
    )
    worker = ModelWorker(cfg, FSDPConfig(), "policy", rank, world, on_gpu)
    start = time.perf_counter()
    worker.setup(args.model)
    say(
        f"worker built in {time.perf_counter() - start:.1f} s: {type(worker.model).__name__}, "
        f"attention {worker.model.config._attn_implementation}, autocast {worker.autocast}, "
        f"padded {worker.padded}, torch {torch.__version__}"
    )
    return worker


def build_bare(args, worker, on_gpu: bool, world: int) -> Bare:
    """AutoModel as it comes, from the same checkpoint, on the worker's mesh."""
    start = time.perf_counter()
    if on_gpu:
        from nemo_automodel import NeMoAutoModelForCausalLM

        model = NeMoAutoModelForCausalLM.from_pretrained(
            args.model,
            distributed_setup=worker.distributed,
            dtype=torch.float32,
            use_liger_kernel=False,
        )
    else:  # AutoModel's factory needs CUDA: transformers' class, sharded by AutoModel
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.float32, attn_implementation="sdpa"
        )
        if world > 1:
            from nemo_automodel.components.distributed.model_parallelizer import (
                parallelize_model,
            )

            model = parallelize_model(model, worker.distributed.mesh_context)
    say(
        f"bare built in {time.perf_counter() - start:.1f} s: {type(model).__name__}, "
        f"attention {model.config._attn_implementation}"
    )
    return Bare(model, on_gpu)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="the checkpoint both sides train")
    p.add_argument("--write-model", help="write a random Qwen3-1.7B-shaped model here, then exit")
    p.add_argument("--seq-lens", default="2048,8192")
    p.add_argument("--default-seq-len", type=int, help="the summary's; default: the first")
    p.add_argument("--tokens-per-step", type=int, default=16384)
    p.add_argument("--trained-share", type=float, default=0.75, help="0.25: an agent's rows")
    p.add_argument("--max-tokens-per-microbatch", type=int, default=8192)
    p.add_argument("--entropy-coefs", default="0,0.01")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sections", default=",".join(SECTIONS), help=", ".join(SECTIONS))
    p.add_argument("--out", help="raw results go here (default: a new temporary directory)")
    p.add_argument("--cpu", action="store_true", help="check the script on CPU (a tiny model)")
    p.add_argument(
        "--resident",
        choices=("both", "one"),
        default="both",
        help="one: the RL model's runs, then the bare model's (one in memory at a time)",
    )
    args = p.parse_args()
    args.seq_lens = [int(x) for x in args.seq_lens.split(",")]
    args.entropy_coefs = [float(x) for x in args.entropy_coefs.split(",")]
    args.sections = set(args.sections.split(","))
    if unknown := args.sections - set(SECTIONS):
        p.error(f"--sections: no section {', '.join(sorted(unknown))} (of {', '.join(SECTIONS)})")
    if not 0 < args.trained_share < 1:
        p.error(f"--trained-share {args.trained_share}: a share of each sample, in (0, 1)")
    args.default_seq_len = args.default_seq_len or args.seq_lens[0]
    if args.default_seq_len not in args.seq_lens:
        p.error(f"--default-seq-len {args.default_seq_len} is not one of --seq-lens")
    if not args.write_model and not args.model:
        p.error("give --model (or --write-model DIR to make one)")
    return args


def main() -> None:
    args = parse_args()
    on_gpu = not args.cpu and torch.cuda.is_available()
    if args.write_model:
        with torch.device("cuda" if on_gpu else "cpu"):
            write_random_model(args.write_model, **(QWEN3_1_7B if on_gpu else TINY))
        return
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", 1))
    worker = build_worker(args, on_gpu, RANK, world)
    bench = Benchmark(args, worker, on_gpu)
    say("model numbers:", json.dumps(bench.nums))
    # both: every side alternates step by step; one: the RL side, then its model is freed and
    # the bare model built for its own runs on the same tokens
    for sides in [{"rl", "bare"}] if args.resident == "both" else [{"rl"}, {"bare"}]:
        if "bare" in sides:
            bench.bare = build_bare(args, worker, on_gpu, world)
        if "main" in args.sections:
            bench.main(sides)
        if "gather" in args.sections and "rl" in sides:
            bench.gather()
        if "profile" in args.sections and on_gpu:
            bench.profile(sides)
        bench.dump()
        if sides == {"rl"}:
            # every holder of the model: its weights' view for the refit included
            worker.model = worker.optimizer = worker.scheduler = worker.weights = None
            gc.collect()
            left = 0.0
            if on_gpu:
                torch.cuda.empty_cache()
                left = torch.cuda.memory_allocated() / 2**30
            say(f"RL model freed ({left:.2f} GiB still allocated)")
    bench.summary()
    bench.dump()
    dist.barrier()
    worker.shutdown()


if __name__ == "__main__":
    main()
