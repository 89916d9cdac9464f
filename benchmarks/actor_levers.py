"""Issue 12's lever prototypes, for actor_vs_automodel.py: the RL-step variants as patches of
molt_train's module globals (restored after each use), and the benchmark's extra sections
(gather, log-prob, host syncs, profile, FlexAttention, FSDP2 mixed precision). Each measures
one candidate fix before anything in packages/ changes."""

import contextlib
import json
import math
import os
import statistics
import time
import warnings
from collections import Counter

import torch
import torch.nn.functional as F
from actor_bench import RESULTS, Bare, bare_variant, resident, say, set_attn, set_documents


def rl_algo(entropy_coef: float = 0.0):
    """The run config's loss settings as the loop passes them: PPO, token-mean."""
    from molt_train.config import AlgoConfig

    return AlgoConfig(aggregation="token-mean", entropy_coef=entropy_coef)


@contextlib.contextmanager
def rl_patch(worker, bf16_head=False, skip_entropy=False, attn=None, align=False,
             logits=False):  # fmt: skip
    """Levers on the worker, as patches of molt_train.model_worker's and token_stats' globals
    (restored after). attn=None keeps the worker's own attention (molt_documents on GPU since
    the levers). `logits`: the microbatch's [T, V] logits materialised in the compute dtype
    where they carry a gradient, for molt_algos' `logprobs_from_logits` (no recompute in
    backward: 3 LM-head GEMMs instead of 4, T·V·2 bytes kept; forward-only stays chunked)."""
    import molt_train.model_worker as wm
    import molt_train.token_stats as ts
    from molt_algos.logprobs import logprobs_from_logits

    orig_lp, orig_pack = ts.token_logprobs_and_entropy, wm.pack
    compute = wm.DTYPES[worker.cfg.dtype] if worker.on_gpu else torch.float32

    def logprobs(hidden, weight, targets, temperature, chunk_size, with_entropy):
        if bf16_head and hidden.dtype != compute:
            hidden, weight = hidden.to(compute), weight.to(compute)
        if logits and torch.is_grad_enabled() and hidden.requires_grad:
            skip = skip_entropy and with_entropy
            lp, ent = logprobs_from_logits(hidden @ weight.T, targets, temperature, chunk_size,
                                           with_entropy and not skip)  # fmt: skip
            return lp, torch.zeros_like(lp) if skip else ent
        if align:  # backward's vocabulary slice width ceil(chunk V / T) a multiple of 8 (16 B)
            n, vocab, c = hidden.numel() // hidden.shape[-1], weight.shape[0], chunk_size
            while math.ceil(c * vocab / max(n, 1)) % 8 and c < chunk_size + 4096:
                c += 1
            chunk_size = c
        if skip_entropy and with_entropy:
            lp, _ = orig_lp(hidden, weight, targets, temperature, chunk_size, False)
            return lp, torch.zeros_like(lp)
        return orig_lp(hidden, weight, targets, temperature, chunk_size, with_entropy)

    def pack(samples, device, padded=False):
        batch = orig_pack(samples, device, padded)
        set_documents(batch.lengths, device)
        return batch

    ts.token_logprobs_and_entropy, wm.pack = logprobs, pack
    own_attn = worker.model.config._attn_implementation
    set_attn(worker.model, attn or own_attn)
    try:
        yield
    finally:
        ts.token_logprobs_and_entropy, wm.pack = orig_lp, orig_pack
        set_attn(worker.model, own_attn)


RL_VARIANTS = {
    "rl": {},
    # after the levers: the real code with transformers' SDPA and dense block mask instead of
    # molt_train.attention (levers 1, 3, 4, 5 alone), and without the entropy's forward
    "rl+sdpa": dict(attn="sdpa"),
    "rl+noent": dict(skip_entropy=True),
    "rl+bf16head": dict(bf16_head=True),
    "rl+varlen": dict(attn="molt_varlen"),
    "rl+both": dict(bf16_head=True, attn="molt_varlen"),
    "rl+all": dict(bf16_head=True, attn="molt_varlen", skip_entropy=True),
    "rl+flex": dict(bf16_head=True, attn="molt_flex"),
    "rl+both-gqa": dict(bf16_head=True, attn="molt_varlen_gqa"),
    "rl+auto": dict(bf16_head=True, attn="molt_auto"),
    "rl+auto-noent": dict(bf16_head=True, attn="molt_auto", skip_entropy=True),
    "rl+auto-align": dict(bf16_head=True, attn="molt_auto", align=True),
    "rl+auto-align-noent": dict(bf16_head=True, attn="molt_auto", align=True, skip_entropy=True),
    # the real code plus materialised logits in the training step (issue 12, after-4's gap)
    "rl+logits": dict(logits=True),
    "rl+logits-noent": dict(logits=True, skip_entropy=True),
}


def gather_levers(args, ctx) -> None:
    """The refit gather against a bare state-dict loop casting to bf16, and prototypes."""
    from torch.distributed.tensor import DTensor
    from transformers.core_model_loading import revert_weight_conversion

    import molt_train.model_worker as wm

    worker, timer = ctx["worker"], ctx["timer"]
    model = worker.model
    bf16 = torch.bfloat16
    sharded = any(isinstance(v, DTensor) for v in model.state_dict().values())

    def full(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    def worker_gather():
        return sum(t.numel() for _, t in worker.named_full_tensors(bf16))

    def bare_loop():  # sharded: each tensor cast, then gathered (DTensor.full_tensor)
        return sum(full(v.detach().to(bf16)).numel() for v in model.state_dict().values())

    def state_dict_only():
        return len(model.state_dict())

    def one_revert():  # one conversion call for the whole state dict, not one per tensor
        sd = {wm._hf_name(k): v.detach().to(bf16) for k, v in model.state_dict().items()}
        return sum(t.numel() for t in revert_weight_conversion(model, sd).values())

    def no_revert():  # the per-tensor loop without the per-tensor conversion call
        return sum(v.detach().to(bf16).numel() for k, v in model.state_dict().items()
                   if wm._hf_name(k))  # fmt: skip

    def revert_only():
        sd = model.state_dict()
        n = 0
        for k, v in sd.items():
            n += len(revert_weight_conversion(model, {wm._hf_name(k): v}))
        return n

    def foreach_cast():  # one multi-tensor cast
        vals = [v.detach() for v in model.state_dict().values()]
        outs = [torch.empty_like(v, dtype=bf16) for v in vals]
        torch._foreach_copy_(outs, vals)
        return len(outs)

    probes = [("named_full_tensors", worker_gather), ("bare_loop", bare_loop),
              ("state_dict_only", state_dict_only)]  # fmt: skip
    if not sharded:  # the world-of-one prototypes (plain tensors)
        probes += [("revert_only_per_tensor", revert_only), ("loop_no_revert", no_revert),
                   ("one_revert_call", one_revert), ("foreach_copy_cast", foreach_cast)]  # fmt: skip
    res = {}
    for name, fn in probes:
        ts = []
        for _ in range(args.warmup + args.steps):
            s, _, _ = timer(fn)
            ts.append(s)
        res[name] = statistics.median(ts[args.warmup :])
    nbytes = sum(full(v).numel() for v in model.state_dict().values()) * 2
    res["sharded"] = sharded
    res["gb_bf16"] = nbytes / 1e9
    res["ratio_named_full_tensors_vs_bare"] = res["named_full_tensors"] / res["bare_loop"]
    res["adapter"] = type(getattr(model, "state_dict_adapter", None)).__name__
    res["weight_conversions"] = repr(getattr(model, "_weight_conversions", "absent"))[:200]
    RESULTS["levers"]["gather"] = res
    say("gather:", json.dumps(res))


def logprob_levers(args, ctx) -> None:
    """The chunked log-prob function alone at one microbatch (8192 tokens): as the worker runs
    it under autocast over fp32 params (fp32 inputs), with bf16 inputs, TF32, larger chunks,
    against autograd over materialised bf16 logits and the bare model's cross-entropy."""
    from molt_algos.logprobs import token_logprobs_and_entropy

    worker, timer = ctx["worker"], ctx["timer"]
    if not worker.on_gpu:
        return
    dev = worker.device
    T = args.max_tokens_per_microbatch
    W = worker.model.lm_head.weight.detach()
    V, H = W.shape
    g = torch.Generator(device=dev).manual_seed(0)
    h32 = torch.randn(T, H, device=dev, generator=g) * 0.5
    tgt = torch.randint(0, V, (T,), device=dev, generator=g)
    res = {}

    def case(name, dtype, autocast, entropy, chunk=1024, tf32=False, kind="chunked"):
        h = h32.to(dtype).detach().requires_grad_()
        w = W.to(dtype).detach().requires_grad_()

        def go():
            h.grad = w.grad = None
            ac = torch.autocast("cuda", torch.bfloat16) if autocast else contextlib.nullcontext()
            with ac:
                if kind == "chunked":
                    lp, ent = token_logprobs_and_entropy(h, w, tgt, 1.0, chunk, entropy)
                    loss = lp.sum() + (ent.sum() * 0.01 if entropy else 0)
                elif kind == "naive":
                    logits = h @ w.T
                    logp = torch.log_softmax(logits.float(), -1)
                    loss = logp.gather(1, tgt[:, None]).sum()
                    if entropy:
                        loss = loss + 0.01 * (-(logp.exp() * logp).sum(-1)).sum()
                else:  # the bare model's loss: CE over fp32 logits
                    logits = (h @ w.T).float()
                    loss = F.cross_entropy(logits, tgt)
            loss.backward()

        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            ts, peak = [], 0.0
            for i in range(args.warmup + args.steps):
                s, p, _ = timer(go)
                if i >= args.warmup:
                    ts.append(s)
                    peak = max(peak, p)
            res[name] = dict(s=statistics.median(ts), peak_gb=peak)
        except Exception as error:
            res[name] = dict(failed=repr(error)[:200])
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev

    f32, bf = torch.float32, torch.bfloat16
    case("worker_today_fp32_in_autocast_ent", f32, True, True)
    case("worker_today_fp32_in_autocast_noent", f32, True, False)
    case("fp32_in_autocast_tf32_ent", f32, True, True, tf32=True)
    case("bf16_in_ent", bf, False, True)
    case("bf16_in_noent", bf, False, False)
    case("bf16_in_ent_chunk4096", bf, False, True, chunk=4096)
    case("naive_autograd_bf16_logits_ent", bf, False, True, kind="naive")
    case("naive_autograd_bf16_logits_noent", bf, False, False, kind="naive")
    case("bare_ce_fp32_logits", bf, False, False, kind="ce")
    # forward-only (old policy / reference)
    with torch.no_grad():
        for name, dtype, ac in [
            ("fwd_only_fp32_in_autocast", f32, True),
            ("fwd_only_bf16", bf, False),
        ]:
            ctxm = torch.autocast("cuda", bf) if ac else contextlib.nullcontext()
            ts = []
            for _ in range(args.warmup + args.steps):

                def go(dtype=dtype, ctxm=ctxm):
                    with ctxm:
                        token_logprobs_and_entropy(
                            h32.to(dtype), W.to(dtype), tgt, 1.0, 1024, False
                        )

                s, _, _ = timer(go)
                ts.append(s)
            res[name] = dict(s=statistics.median(ts[args.warmup :]))
    flop3 = 3 * 2 * T * H * V
    res["lm_head_fwd_bwd_tflop"] = flop3 / 1e12
    RESULTS["levers"]["logprob_fn"] = res
    say("logprob function at", T, "tokens:", json.dumps(res))


def host_levers(args, ctx) -> None:
    """Host side: packing the microbatches, the to_lists of forward_logprobs, and the host
    syncs of one RL step (counted with torch.cuda.set_sync_debug_mode)."""
    from molt_train.packing import pack

    worker, timer = ctx["worker"], ctx["timer"]
    mine, num_tokens, num_seq, _, _ = ctx["last"][args.default_seq_len]
    res = {}
    s, _, batches = timer(lambda: [pack(mb, worker.device) for mb in mine])
    res["pack_all_microbatches_s"] = s
    rows = [torch.zeros(b.valid.shape, device=worker.device) for b in batches]
    s, _, _ = timer(lambda: [b.to_lists(r) for b, r in zip(batches, rows, strict=True)])
    res["to_lists_s"] = s
    if worker.on_gpu:
        sites: Counter = Counter()

        def show(message, category, filename, lineno, file=None, line=None):
            sites[f"{os.path.basename(filename)}:{lineno}"] += 1

        old_show = warnings.showwarning
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                worker.train_step(mine, num_tokens, num_seq, rl_algo())
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old_show
        res["host_syncs_per_step"] = sum(sites.values())
        res["host_sync_sites"] = dict(sites.most_common(20))
    RESULTS["levers"]["host"] = res
    say("host:", json.dumps(res))


def profile_step(args, ctx, out_dir) -> None:
    from torch.profiler import ProfilerActivity, profile

    worker, timer = ctx["worker"], ctx["timer"]
    if not worker.on_gpu:
        return
    mine, num_tokens, num_seq, bare_mbs, _ = ctx["last"][args.default_seq_len]
    summary = {}

    def rl(name):
        def go():
            with rl_patch(worker, **RL_VARIANTS[name]):
                return worker.train_step(mine, num_tokens, num_seq, rl_algo())

        return go

    todo = []
    for name in [v for v in args.profile_variants.split(",") if resident(ctx, v)]:
        if name.startswith("rl"):
            todo.append((name, rl(name)))
        else:
            b = bare_variant(ctx["bares"], name)
            todo.append((name, lambda b=b: b.step(bare_mbs)))
    for name, fn in todo:
        fn()
        timer.sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            fn()
            timer.sync()
            wall = time.perf_counter() - start
        events = prof.key_averages()

        def dev_self(e):
            return getattr(e, "self_device_time_total", None) or getattr(
                e, "self_cuda_time_total", 0
            )

        kernels = [e for e in events if getattr(e, "device_type", None) is not None
                   and str(e.device_type).endswith("CUDA") and dev_self(e) > 0
                   and "#" not in e.key and not e.key.startswith("ProfilerStep")]  # fmt: skip
        busy_us = sum(dev_self(e) for e in kernels)
        # exact: the union of device-event intervals (kernels, copies, sets), annotations out
        spans = sorted(
            (e.time_range.start, e.time_range.end) for e in prof.events()
            if str(getattr(e, "device_type", "")).endswith("CUDA")
            and not getattr(e, "is_user_annotation", False) and "#" not in e.name[:40]
            and not e.name.startswith(("Optimizer.", "ProfilerStep"))
        )  # fmt: skip
        union, cur_s, cur_e = 0.0, None, None
        for a, b in spans:
            if cur_e is None or a > cur_e:
                if cur_e is not None:
                    union += cur_e - cur_s
                cur_s, cur_e = a, b
            else:
                cur_e = max(cur_e, b)
        if cur_e is not None:
            union += cur_e - cur_s
        window = (spans[-1][1] - spans[0][0]) / 1e6 if spans else 0.0
        busy_us = union
        top = sorted(kernels, key=dev_self, reverse=True)[:25]
        cpu = {e.key: e.count for e in events if e.key in (
            "cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::item",
            "aten::_local_scalar_dense", "cudaMemcpyAsync", "cudaLaunchKernel",
            "cuLaunchKernel", "aten::nonzero")}  # fmt: skip
        summary[name] = dict(
            wall_s=wall,
            gpu_busy_s=busy_us / 1e6,
            gpu_idle_s=wall - busy_us / 1e6,
            first_to_last_kernel_s=window,
            gaps_between_kernels_s=window - busy_us / 1e6,
            kernels_launched=sum(e.count for e in kernels),
            cpu_calls=cpu,
            top=[(e.key[:90], e.count, round(dev_self(e) / 1e3, 2)) for e in top],
        )
        sort = "self_cuda_time_total"
        try:
            table = events.table(sort_by="self_device_time_total", row_limit=30)
        except Exception:
            table = events.table(sort_by=sort, row_limit=30)
        if out_dir:
            with open(os.path.join(out_dir, f"profile_{name.replace('+', '_')}.txt"), "w") as f:
                f.write(table)
        say(f"profile {name}: wall {wall:.3f}s gpu busy {busy_us / 1e6:.3f}s "
            f"idle {wall - busy_us / 1e6:.3f}s (gaps between kernels {window - busy_us / 1e6:.3f}s) "
            f"kernels {summary[name]['kernels_launched']} "
            f"cpu {json.dumps(cpu)}")  # fmt: skip
        for k, c, ms in summary[name]["top"][:15]:
            say(f"   {ms:9.2f} ms  x{c:<5d} {k}")
    RESULTS["profile"] = summary


def flex_lever(args, ctx) -> None:
    """FlexAttention (transformers' BlockMask from the restarting position ids, compiled
    kernels) for the RL step (with bf16head) and the bare step, at the default setting."""

    worker, timer = ctx["worker"], ctx["timer"]
    mine, num_tokens, num_seq, bare_mbs, samples = ctx["last"][args.default_seq_len]
    tokens = sum(len(s.token_ids) for s in samples)
    bare = ctx["bares"]["bare"]
    res = {}

    def rl():
        with rl_patch(worker, **RL_VARIANTS["rl+flex"]):
            return worker.train_step(mine, num_tokens, num_seq, rl_algo())

    def bare_flex():
        bare.attn = "molt_flex"
        try:
            return bare.step(bare_mbs)
        finally:
            bare.attn = "sdpa"

    for name, fn in [("rl+flex", rl), ("bare+flex", bare_flex)]:
        try:
            t0 = time.perf_counter()
            fn()  # compiles
            res[f"{name}_first_call_s"] = time.perf_counter() - t0
            ts, peak = [], 0.0
            for i in range(args.warmup + args.steps):
                s, p, _ = timer(fn)
                if i >= args.warmup:
                    ts.append(s)
                    peak = max(peak, p)
            t = statistics.median(ts)
            res[name] = dict(s=t, tok_s=tokens / t, peak_gb=peak)
        except Exception as error:
            res[name] = dict(failed=repr(error)[:300])
        say("flex:", json.dumps(res))
    RESULTS["levers"]["flex"] = res


def fsdp_mp_levers(args, ctx, seq_len) -> None:
    """bf16 parameters (bare) and FSDP2's mixed-precision policy on a one-rank mesh (RL)
    instead of autocast over fp32 parameters. Runs last: it reshapes the worker's model."""
    from nemo_automodel import NeMoAutoModelForCausalLM
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    worker, timer = ctx["worker"], ctx["timer"]
    mine, num_tokens, num_seq, bare_mbs, samples = ctx["last"][seq_len]
    tokens = sum(len(s.token_ids) for s in samples)
    # free the fp32 bare model
    b = ctx["bares"].pop("bare")
    del b.opt, b.model, b
    ctx["bares"].pop("bare+varlen", None)
    torch.cuda.empty_cache()
    res = {}
    model16 = NeMoAutoModelForCausalLM.from_pretrained(
        args.model, distributed_setup=worker.setup_, dtype=torch.bfloat16, use_liger_kernel=False
    )
    bare16 = Bare(model16, None, worker.device)
    for attn in ("sdpa", "molt_varlen"):
        bare16.attn = attn
        ts, peak = [], 0.0
        for i in range(args.warmup + args.steps):
            s, p, _ = timer(lambda b=bare16: b.step(bare_mbs))
            if i >= args.warmup:
                ts.append(s)
                peak = max(peak, p)
        t = statistics.median(ts)
        res[f"bare-bf16-params+{attn}"] = dict(s=t, tok_s=tokens / t, peak_gb=peak)
    del bare16, model16
    torch.cuda.empty_cache()
    # FSDP2 mixed precision on a one-rank mesh over the worker's fp32 model
    try:
        model = worker.model
        mesh = init_device_mesh("cuda", (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        worker.autocast = False
        worker.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                             lr=1e-6, betas=(0.9, 0.999), eps=1e-8,
                                             weight_decay=0.0)  # fmt: skip
        worker.scheduler = torch.optim.lr_scheduler.LambdaLR(worker.optimizer, lambda s: 1.0)
        for name in ("rl", "rl+both"):
            ts, peak = [], 0.0
            for i in range(args.warmup + args.steps):

                def go(name=name):
                    with rl_patch(worker, **RL_VARIANTS[name]):
                        return worker.train_step(mine, num_tokens, num_seq, rl_algo())

                s, p, _ = timer(go)
                if i >= args.warmup:
                    ts.append(s)
                    peak = max(peak, p)
            t = statistics.median(ts)
            res[f"{name}-fsdp2-mp"] = dict(s=t, tok_s=tokens / t, peak_gb=peak)
        s, _, _ = timer(
            lambda: sum(t.numel() for _, t in worker.named_full_tensors(torch.bfloat16))
        )
        res["named_full_tensors_fsdp2_s"] = s
    except Exception as error:
        res["fsdp2_mp_failed"] = repr(error)[:300]
    RESULTS["levers"]["dtype_policy"] = res
    say(f"dtype policy at {seq_len}:", json.dumps(res))
