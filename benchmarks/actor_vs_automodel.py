"""The RL policy step side by side with a bare NeMo AutoModel step, on one checkpoint and one
set of tokens (issue 12). Measurement only: the project's code runs unchanged; the candidate
fixes ("levers") are prototyped here, as patches of module globals, so that each one's effect
is a measured number before anything in packages/ changes.

One torchrun process per GPU (a world of one is what it was written and run for; at
--nproc-per-node 2 the bare model is sharded like the worker's, FSDP2 over both ranks, and
the gather section compares with a bare loop of `full_tensor()` calls):

    # a random Qwen3-1.7B-shaped checkpoint (actor_gpu_smoke's writer, run on the GPU)
    python benchmarks/actor_vs_automodel.py --write-model /tmp/q3
    PYTHONPATH=packages/molt-algos/src:packages/molt-train/src:benchmarks:/tmp/site \\
      torchrun --nproc-per-node 1 benchmarks/actor_vs_automodel.py --model /tmp/q3

(/tmp/site: AutoModel 0.7.0 and its wheels, from ../shared/gpu's `train` set.) On a card that
cannot hold both 1.7B models' steps (80 GB), `--resident one` runs every RL variant, frees that
model, then builds the bare one for its variants on the same tokens, and joins the ratios; the
flex and dtype sections need both models at once and are refused with it. A `--cpu` run on
a tiny model (`--write-model DIR --cpu`) checks the script and the attention levers' CPU
reference (SDPA per document) without a GPU.

What it prints (rank 0), per setting (sequence length x entropy) and variant:
  - step time (median of --steps after --warmup), tokens/s/GPU, MFU, peak memory;
  - ratio = RL tokens/s / bare tokens/s (the issue's `step ratio`);
  - forward-only log-probs (the worker's old-policy / reference pass) against a bare forward;
  - the refit gather (`ModelWorker.named_full_tensors(bf16)`) against a bare state-dict loop.

MFU: model FLOPs / (seconds x 989.4e12, the H200's dense bf16 rate by its datasheet), with
  FLOPs(step)    = 6 N T + 6 L h d sum_i s_i^2
  FLOPs(forward) = 2 N T + 2 L h d sum_i s_i^2
N = parameters without the input embedding (lm_head counted), T = tokens, L = layers, h = query
heads, d = head size, s_i = each document's length (causal attention within a document: half of
the 4 L h d s^2 forward multiply-adds of a full s x s attention). Work the kernels do beyond
that (the dense block mask makes SDPA compute the whole T x T square of a packed row; the
log-prob backward recomputes the LM-head matmul) is not counted.

Variants of the RL step (each a patch in actor_levers.py, never in packages/):
  rl                   ModelWorker.train_step as it is. Since the levers went into packages/
                       (docs/benchmarks.md, "after the levers") it has the compute-dtype
                       log-prob backward, aligned slices, no entropy gradient at coefficient 0
                       and molt_train.attention's document attention, so the patches below
                       that re-apply a lever change nothing more
  rl+sdpa              the same with transformers' SDPA and dense block mask (the attention
                       lever alone undone); rl+noent: no entropy computed at coefficient 0
  rl+bf16head          hidden states and LM-head weight cast to the compute dtype before the
                       chunked log-prob function, so its backward matmuls run in bf16 (today
                       they run in fp32: autocast does not reach a custom Function's backward)
  rl+varlen            attention through torch.nn.attention.varlen (FlashAttention over
                       cu_seqlens from the packed lengths, no mask) instead of SDPA with the
                       dense block mask transformers builds for restarting position ids
  rl+both              bf16head + varlen; rl+both-gqa: varlen without repeating K/V heads
  rl+auto              bf16head + varlen for rows of several documents, SDPA's causal path
                       (cuDNN, no mask) for rows of one
  rl+auto-align        + the backward's vocabulary slice width rounded to a multiple of 8
                       (picking the chunk size), so cuBLAS gets 16-byte-aligned leading dims
  rl+all, rl+auto-noent, rl+auto-align-noent: + no entropy when its coefficient is 0
  rl+flex              bf16head + transformers' FlexAttention path (BlockMask, compiled)
Bare variants: bare (AutoModel as it comes: fp32 params under autocast, packed rows, SDPA with
  the dense block mask), bare+varlen, bare+gqa, bare+auto (the same attention levers); the
  dtype section adds bare bf16 parameters and rl under FSDP2's MixedPrecisionPolicy on a
  one-rank mesh instead of autocast.

Runs used for docs/benchmarks.md (section "Trainer parity on one H200") are listed there.
"""

import argparse
import gc
import json
import os
import statistics
import time

import torch
from actor_bench import (
    PEAK_FLOPS,
    RESULTS,
    Bare,
    Timer,
    bare_microbatches,
    bare_variant,
    dump,
    flops,
    model_numbers,
    register_attention,
    resident,
    say,
    static_bytes,
    write_model,
)
from actor_levers import (
    RL_VARIANTS,
    flex_lever,
    fsdp_mp_levers,
    gather_levers,
    host_levers,
    logprob_levers,
    profile_step,
    rl_algo,
    rl_patch,
)


def run_setting(args, ctx, seq_len: int, entropy_coef: float, variants: list[str]) -> None:
    from actor_gpu_smoke import random_samples

    from molt_train.packing import plan_microbatches

    worker, bares, timer, nums = ctx["worker"], ctx["bares"], ctx["timer"], ctx["nums"]
    vocab = nums["vocab"]
    count = max(1, args.tokens_per_step // seq_len)
    samples = random_samples(vocab, count, seq_len, seed=seq_len)
    plan = plan_microbatches(samples, args.max_tokens_per_microbatch, 1, worker.padded)
    mine = [[samples[i] for i in mb] for mb in plan[0]]
    lengths = [len(s.token_ids) for s in samples]
    tokens = sum(lengths)
    # forward-only log-probs (old policy / reference pass) vs a bare forward
    bare_mbs = bare_microbatches(mine, worker.device)
    fwd = {}
    for v in ["rl", "bare"] + [x for x in args.fwd_variants.split(",") if x]:
        if resident(ctx, v):
            fwd[f"{v}-fwd"] = (v, None) if v.startswith("rl") else (None, v)
    fwd_times = {k: [] for k in fwd}
    old = None

    def fwd_call(rl_name, bare_name):
        if rl_name:

            def go():
                with rl_patch(worker, **RL_VARIANTS[rl_name]):
                    return worker.forward_logprobs(mine)

            return go
        b = bare_variant(bares, bare_name)
        return lambda: b.forward(bare_mbs)

    for i in range(args.warmup + args.steps):
        for key, (rl_name, bare_name) in fwd.items():
            s, _, result = timer(fwd_call(rl_name, bare_name))
            if key == "rl-fwd":
                old = result
            if i >= args.warmup:
                fwd_times[key].append(s)
    if old is not None:  # the RL step's old-policy log-probs
        for mb, values in zip(mine, old, strict=True):
            for sample, lp in zip(mb, values, strict=True):
                sample.old_logprobs = lp
    num_tokens = sum(s.num_trained for s in samples)
    num_sequences = sum(1 for s in samples if s.num_trained)
    fwd_flops = flops(nums, lengths, backward=False)
    med = {k: statistics.median(v) for k, v in fwd_times.items()}
    for k, v in med.items():
        row = dict(setting=f"{seq_len}", entropy="-", variant=k, s=v, tok_s=tokens / v,
                   mfu=fwd_flops / v / PEAK_FLOPS, peak_gb=None)  # fmt: skip
        RESULTS["rows"].append(row)
    say(f"[{seq_len}] forward-only: " + "  ".join(f"{k} {v:.3f}s" for k, v in med.items()))

    def rl_step(patch):
        def go():
            with rl_patch(worker, **patch):
                return worker.train_step(mine, num_tokens, num_sequences,
                                         rl_algo(entropy_coef))  # fmt: skip

        return go

    steps = {}
    for name in variants:
        if name == "rl+all" and entropy_coef:  # it drops the entropy term: only at coef 0
            continue
        if not resident(ctx, name):
            continue
        if name.startswith("rl"):
            steps[name] = rl_step(RL_VARIANTS[name])
        else:
            b = bare_variant(bares, name)
            steps[name] = lambda b=b: b.step(bare_mbs)
    times = {k: [] for k in steps}
    peaks = {k: 0.0 for k in steps}
    failed = {}
    for i in range(args.warmup + args.steps):
        for name, fn in steps.items():  # alternating
            if name in failed:
                continue
            try:
                s, peak, _ = timer(fn)
            except Exception as error:  # a lever that does not run here: say so, go on
                failed[name] = repr(error)[:300]
                say(f"[{seq_len}] {name} FAILED: {failed[name]}")
                torch.cuda.empty_cache() if worker.on_gpu else None
                continue
            if i >= args.warmup:
                times[name].append(s)
                peaks[name] = max(peaks[name], peak)
    step_flops = flops(nums, lengths, backward=True)
    ent = "on" if entropy_coef else "off"
    for name in steps:
        if name in failed or not times[name]:
            RESULTS["rows"].append(dict(setting=str(seq_len), entropy=ent, variant=name,
                                        failed=failed.get(name)))  # fmt: skip
            continue
        t = statistics.median(times[name])
        row = dict(setting=str(seq_len), entropy=ent, variant=name, s=t, tok_s=tokens / t,
                   mfu=step_flops / t / PEAK_FLOPS, peak_gb=peaks[name],
                   all_s=[round(x, 4) for x in times[name]])  # fmt: skip
        RESULTS["rows"].append(row)
    add_ratios(str(seq_len), ent)
    say(f"[{seq_len} entropy {ent}] " + "  ".join(
        f"{r['variant']} {r['s']:.3f}s {r['tok_s']:.0f}tok/s mfu {r['mfu']:.1%} "
        f"peak+{r['peak_gb']:.1f}GB ratio {r.get('ratio', float('nan')):.2f}"
        for r in RESULTS["rows"]
        if r.get("setting") == str(seq_len) and r.get("entropy") == ent and "s" in r
    ))  # fmt: skip
    ctx.setdefault("last", {})[seq_len] = (mine, num_tokens, num_sequences, bare_mbs, samples)


def add_ratios(setting: str, ent: str) -> None:
    """Each step's tokens/s over the bare step's (and over bare+auto's, the same attention),
    once both are in RESULTS: in one phase, or across the two of --resident one."""
    rows = [r for r in RESULTS["rows"]
            if r.get("setting") == setting and r.get("entropy") == ent and "tok_s" in r]  # fmt: skip
    base = {r["variant"]: r["tok_s"] for r in rows if r["variant"] in ("bare", "bare+auto")}
    for row in rows:
        if "bare" in base:
            row["ratio"] = row["tok_s"] / base["bare"]
        if "bare+auto" in base:
            row["ratio_vs_bare_auto"] = row["tok_s"] / base["bare+auto"]


def summary(args) -> None:
    """The issue's numbers, one line each: the step ratio (RL tokens/s / bare tokens/s) per
    setting and the forward-only pass against a bare forward."""
    rows = {(r["setting"], r["entropy"], r["variant"]): r for r in RESULTS["rows"] if "s" in r}
    for (setting, ent, variant), row in sorted(rows.items()):
        if variant == "rl" and "ratio" in row:
            say(f"[{setting} entropy {ent}] step ratio {row['ratio']:.2f} "
                f"(rl {row['s']:.3f} s, bare {rows[setting, ent, 'bare']['s']:.3f} s)")  # fmt: skip
        if variant == "rl-fwd" and (setting, "-", "bare-fwd") in rows:
            bare = rows[setting, "-", "bare-fwd"]["s"]
            say(f"[{setting}] forward-only ratio {bare / row['s']:.2f} (bare time / rl time)")
    default = rows.get((str(args.default_seq_len), "off", "rl"), {})
    if "ratio" in default:
        say(f"step ratio {default['ratio']:.2f}")


def correctness(args, ctx) -> None:
    """Packing isolates sequences under the new attention path too, and it agrees with SDPA's
    dense-mask path."""
    from actor_gpu_smoke import random_samples

    worker = ctx["worker"]
    vocab = ctx["nums"]["vocab"]
    check = random_samples(vocab, 4, 300, seed=1)
    out = {}
    for attn in ("sdpa", "molt_varlen", "molt_varlen_gqa", "molt_auto", "molt_documents"):
        with rl_patch(worker, attn=attn):
            packed = worker.forward_logprobs([check])[0]
            alone = [worker.forward_logprobs([[s]])[0][0] for s in check]
        diff = max(abs(a - b) for p, q in zip(packed, alone, strict=True)
                   for a, b in zip(p, q, strict=True))  # fmt: skip
        out[f"packed_vs_alone_{attn}"] = diff
        out[f"packed_{attn}"] = packed
    out["sdpa_vs_varlen"] = max(
        abs(a - b)
        for p, q in zip(out["packed_sdpa"], out["packed_molt_varlen"], strict=True)
        for a, b in zip(p, q, strict=True)
    )
    for attn in ("molt_varlen_gqa", "molt_auto", "molt_documents"):
        out[f"varlen_vs_{attn}"] = max(
            abs(a - b) for p, q in zip(out["packed_molt_varlen"], out[f"packed_{attn}"], strict=True)
            for a, b in zip(p, q, strict=True))  # fmt: skip
    for attn in ("sdpa", "molt_varlen", "molt_varlen_gqa", "molt_auto", "molt_documents"):
        del out[f"packed_{attn}"]
    RESULTS["correctness"] = out
    say("correctness (max abs log-prob diff):", json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--write-model")
    p.add_argument("--seq-lens", default="2048,8192")
    p.add_argument("--default-seq-len", type=int, default=2048)
    p.add_argument("--tokens-per-step", type=int, default=16384)
    p.add_argument("--max-tokens-per-microbatch", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--entropy-coefs", default="0,0.01")
    p.add_argument(
        "--variants",
        default="rl,bare,rl+bf16head,rl+varlen,rl+auto,rl+auto-align,"
        "rl+auto-align-noent,bare+varlen,bare+auto",
    )
    p.add_argument("--fwd-variants", default="rl+auto-align,bare+auto")
    p.add_argument("--profile-variants", default="rl,bare,rl+auto-align,bare+auto")
    p.add_argument("--lever-variants", default="", help="extra variants, default setting only")
    p.add_argument("--sections", default="main,correct,gather,logprob,host,profile,flex,dtype")
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--cpu", action="store_true")
    p.add_argument(
        "--resident",
        choices=("both", "one"),
        default="both",
        help="one: the RL model's runs, then the bare model's (one in memory at a time)",
    )
    args = p.parse_args()
    sections = set(args.sections.split(","))
    if args.resident == "one" and sections & {"flex", "dtype"}:
        p.error("--resident one holds one model at a time; --sections flex and dtype compare "
                "both in one process: leave them out of --sections")  # fmt: skip
    on_gpu = not args.cpu and torch.cuda.is_available()
    if args.write_model:
        write_model(args.write_model, on_gpu)
        return

    import torch.distributed as dist

    from molt_train.actor_config import ActorConfig, FSDPConfig, OptimConfig
    from molt_train.model_worker import ModelWorker

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    register_attention()
    cfg = ActorConfig(model_path=args.model, num_workers=world, dtype="bf16",
                      max_tokens_per_microbatch=args.max_tokens_per_microbatch,
                      optim=OptimConfig(lr=1e-6))  # fmt: skip
    worker = ModelWorker(cfg, FSDPConfig(), "policy", rank, world, on_gpu)
    t0 = time.perf_counter()
    worker.setup(args.model)
    say(f"worker built in {time.perf_counter() - t0:.1f}s: {type(worker.model).__name__}, "
        f"attn {worker.model.config._attn_implementation}, autocast {worker.autocast}, "
        f"padded {worker.padded}, torch {torch.__version__}")  # fmt: skip
    nums = model_numbers(worker.model)
    RESULTS.update(model=nums, torch=torch.__version__, device=torch.cuda.get_device_name() if on_gpu else "cpu",
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), args=vars(args))  # fmt: skip
    say("model numbers:", json.dumps(nums))
    ctx = dict(worker=worker, bares={}, timer=Timer(on_gpu), nums=nums, static_gb={})
    # both: every variant alternates step by step; one: the RL model's runs, then it is freed and
    # the bare model built for its own (an 80 GB GPU does not hold both 1.7B models' steps)
    for phase in [{"rl", "bare"}] if args.resident == "both" else [{"rl"}, {"bare"}]:
        ctx["resident"] = phase
        if "bare" in phase:
            ctx["bares"] = build_bare(args, worker, on_gpu, world)
        run_phase(args, ctx, sections, on_gpu)
        if phase == {"rl"}:
            worker.model = worker.optimizer = worker.scheduler = None
            gc.collect()
            left = 0.0
            if on_gpu:
                torch.cuda.empty_cache()
                left = torch.cuda.memory_allocated() / 2**30
            say(f"RL model freed ({left:.2f} GiB still allocated)")
    summary(args)
    dump(args.out)
    say("RESULTS_JSON", json.dumps({k: RESULTS[k] for k in ("rows",)}, default=str)[:100])
    dist.barrier()
    worker.shutdown()


def build_bare(args, worker, on_gpu: bool, world: int) -> dict:
    """AutoModel as it comes, from the same checkpoint, on the worker's mesh."""
    t0 = time.perf_counter()
    if on_gpu:
        from nemo_automodel import NeMoAutoModelForCausalLM

        bare_model = NeMoAutoModelForCausalLM.from_pretrained(
            args.model, distributed_setup=worker.setup_, dtype=torch.float32,
            use_liger_kernel=False,
        )  # fmt: skip
    else:
        from transformers import AutoModelForCausalLM

        bare_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                          attn_implementation="sdpa")  # fmt: skip
        if world > 1:  # the worker's sharding (AutoModel's FSDP2 over the same mesh)
            from nemo_automodel.components.distributed.model_parallelizer import (
                parallelize_model,
            )

            bare_model = parallelize_model(bare_model, worker.setup_.mesh_context)
    bare = Bare(bare_model, torch.bfloat16 if on_gpu else None, worker.device)
    say(f"bare built in {time.perf_counter() - t0:.1f}s: {type(bare_model).__name__}, "
        f"attn {bare_model.config._attn_implementation}")  # fmt: skip
    return {"bare": bare}


def run_phase(args, ctx, sections: set[str], on_gpu: bool) -> None:
    """Every setting's variants whose model is resident, then the sections that need it."""
    worker, bares = ctx["worker"], ctx["bares"]
    variants = args.variants.split(",")
    for seq_len in [int(x) for x in args.seq_lens.split(",")]:
        for coef in [float(x) for x in args.entropy_coefs.split(",")]:
            if "main" in sections:
                extra = (
                    [v for v in args.lever_variants.split(",") if v]
                    if (seq_len == args.default_seq_len and coef == 0)
                    else []
                )
                run_setting(args, ctx, seq_len, coef, variants + extra)
                dump(args.out)
    if "rl" in ctx["resident"]:
        ctx["static_gb"]["rl"] = static_bytes(worker.model, worker.optimizer) / 2**30
    if "bare" in ctx["resident"]:
        ctx["static_gb"]["bare"] = static_bytes(bares["bare"].model, bares["bare"].opt) / 2**30
    RESULTS["static_gb"] = ctx["static_gb"]
    say("static (params + optimizer state) GB:", json.dumps(ctx["static_gb"]))
    rl_only = [("correct", correctness), ("gather", gather_levers), ("logprob", logprob_levers),
               ("host", host_levers)]  # fmt: skip
    for name, fn in rl_only if "rl" in ctx["resident"] else []:
        if name in sections:
            try:
                fn(args, ctx)
            except Exception as error:
                say(f"{name} FAILED: {error!r}"[:400])
            dump(args.out)
    if "profile" in sections:
        try:
            profile_step(args, ctx, args.out)
        except Exception as error:
            say(f"profile FAILED: {error!r}"[:400])
        dump(args.out)
    if "flex" in sections and on_gpu:  # both models resident (main refuses them otherwise)
        flex_lever(args, ctx)
        dump(args.out)
    if "dtype" in sections and on_gpu:
        try:
            fsdp_mp_levers(args, ctx, args.default_seq_len)
        except Exception as error:
            say(f"dtype FAILED: {error!r}"[:400])
        dump(args.out)


if __name__ == "__main__":
    main()
