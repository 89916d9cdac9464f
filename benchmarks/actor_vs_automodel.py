"""The RL policy step side by side with a bare NeMo AutoModel step, on one checkpoint and one
set of tokens (issue 12). Measurement only: the project's code runs unchanged; the candidate
fixes ("levers") are prototyped here, as patches of module globals, so that each one's effect
is a measured number before anything in packages/ changes.

One torchrun process per GPU (a world of one is what it was written and run for):

    # a random Qwen3-1.7B-shaped checkpoint (actor_gpu_smoke's writer, run on the GPU)
    python benchmarks/actor_vs_automodel.py --write-model /tmp/q3
    PYTHONPATH=packages/molt-algos/src:packages/molt-train/src:benchmarks:/tmp/site \\
      torchrun --nproc-per-node 1 benchmarks/actor_vs_automodel.py --model /tmp/q3

(/tmp/site: AutoModel 0.7.0 and its wheels, from ../shared/gpu's `train` set.) A `--cpu` run on
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

Variants of the RL step (each a patch inside this file, never in packages/):
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
import contextlib
import inspect
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections import Counter

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PEAK_FLOPS = 989.4e12  # H200 SXM dense bf16, datasheet
LOG: list[str] = []
RESULTS: dict = {"rows": [], "levers": {}}


def say(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    if int(os.environ.get("RANK", 0)) == 0:
        print(line, flush=True)
    LOG.append(line)


def dump(out_dir: str | None) -> None:
    if out_dir and int(os.environ.get("RANK", 0)) == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


# ------------------------------------------------------------------ attention levers

_CU: dict = {}  # the current microbatch's cu_seqlens, set from the packed lengths (host side)


def set_documents(lengths: list[int], device) -> None:
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    _CU["total"], _CU["max"] = int(sum(lengths)), int(max(lengths))
    _CU["lengths"] = list(lengths)
    _CU["cu"] = cu.to(device, non_blocking=True)


def _documents_from_positions(position_ids: torch.Tensor, device):
    """Fallback (one host sync): document lengths from restarting position ids."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).flatten().tolist()
    lengths = [b - a for a, b in zip(starts, [*starts[1:], pos.numel()], strict=True)]
    set_documents(lengths, device)


_VARLEN = None


def _varlen_call():
    global _VARLEN
    if _VARLEN is None:
        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        _VARLEN = (varlen_attn, set(params))
    return _VARLEN


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     sliding_window=None, **kwargs):  # fmt: skip
    """transformers attention interface: [B=1, H, T, D] in, [1, T, H, D] out, causal within
    each document of the packed row. GPU: torch's varlen FlashAttention; CPU: SDPA per
    document (the reference the GPU path is checked against)."""
    if query.shape[0] != 1:
        raise ValueError("varlen attention expects one packed row")
    total = query.shape[2]
    if _CU.get("total") != total:
        _documents_from_positions(kwargs["position_ids"], query.device)
    q = query[0].transpose(0, 1)  # [T, H, D]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.device.type != "cuda":
        outs, start = [], 0
        rep = q.shape[1] // k.shape[1]
        for n in _CU["lengths"]:
            sl = slice(start, start + n)
            qq, kk, vv = (x[sl].transpose(0, 1) for x in (q, k, v))
            kk, vv = kk.repeat_interleave(rep, 0), vv.repeat_interleave(rep, 0)
            o = F.scaled_dot_product_attention(qq[None], kk[None], vv[None], is_causal=True,
                                               scale=scale)  # fmt: skip
            outs.append(o[0].transpose(0, 1))
            start += n
        return torch.cat(outs)[None], None
    return _varlen_cuda(q, k, v, scale, native_gqa=False)


def _varlen_cuda(q, k, v, scale, native_gqa):
    fn, params = _varlen_call()
    # fp32 parameters under autocast: q/k leave the fp32 q_norm/k_norm and RoPE in fp32 (SDPA
    # is on autocast's bf16 list and casts them itself; FlashAttention takes 16-bit only)
    if q.dtype not in (torch.float16, torch.bfloat16):
        dt = (
            torch.get_autocast_dtype("cuda")
            if torch.is_autocast_enabled("cuda")
            else torch.bfloat16
        )
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    extra = {}
    if "enable_gqa" in params:
        extra["enable_gqa"] = True
    elif k.shape[1] != q.shape[1] and not native_gqa:  # native: FlashAttention's own GQA
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if "is_causal" in params:
        extra["is_causal"] = True
    else:
        extra["window_size"] = (-1, 0)
    if "scale" in params:
        extra["scale"] = scale
    cu = _CU["cu"]
    out = fn(
        q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, _CU["max"], _CU["max"], **extra
    )
    return out[None], None


def varlen_attention_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         sliding_window=None, **kwargs):  # fmt: skip
    """varlen with K/V at their own head count (FlashAttention handles GQA itself)."""
    if query.device.type != "cuda":
        return varlen_attention(module, query, key, value, attention_mask, dropout, scaling,
                                sliding_window, **kwargs)  # fmt: skip
    if _CU.get("total") != query.shape[2]:
        _documents_from_positions(kwargs["position_ids"], query.device)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return _varlen_cuda(q, k, v, scale, native_gqa=True)


def auto_attention(module, query, key, value, attention_mask, **kwargs):
    """One document in the row: SDPA's causal path (cuDNN/flash, no mask); several: varlen."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _CU.get("total") != query.shape[2]:
        _documents_from_positions(kwargs["position_ids"], query.device)
    if len(_CU["lengths"]) == 1 or query.shape[0] != 1:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            None,
            is_causal=True,
            **{k: v for k, v in kwargs.items() if k in ("dropout", "scaling")},
        )
    return varlen_attention_gqa(module, query, key, value, attention_mask, **kwargs)


def flex_attention_16bit(module, query, key, value, attention_mask, **kwargs):
    """transformers' FlexAttention path with q/k/v in the autocast dtype (see above)."""
    from transformers.integrations.flex_attention import flex_attention_forward

    if query.dtype not in (torch.float16, torch.bfloat16) and torch.is_autocast_enabled("cuda"):
        dt = torch.get_autocast_dtype("cuda")
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flex_attention_mask

    AttentionInterface.register("molt_varlen", varlen_attention)
    AttentionInterface.register("molt_flex", flex_attention_16bit)
    AttentionInterface.register("molt_varlen_gqa", varlen_attention_gqa)
    AttentionInterface.register("molt_auto", auto_attention)
    from molt_train.attention import DOCUMENT_ATTENTION, document_attention  # the real one

    AttentionInterface.register(DOCUMENT_ATTENTION, document_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("molt_flex", flex_attention_mask)


def set_attn(model, name: str) -> None:
    model.config._attn_implementation = name


# ------------------------------------------------------------------ model and data


def write_model(path: str, on_gpu: bool) -> None:
    from actor_gpu_smoke import write_random_model

    shape = argparse.Namespace(vocab=151936, hidden=2048, intermediate=6144, layers=28, heads=16,
                               kv_heads=8, moe=False)  # fmt: skip
    if not on_gpu:  # CPU check of the script: a tiny model
        shape = argparse.Namespace(vocab=512, hidden=128, intermediate=256, layers=2, heads=2,
                                   kv_heads=1, moe=False)  # fmt: skip
    with torch.device("cuda" if on_gpu else "cpu"):
        write_random_model(path, shape)


def model_numbers(model) -> dict:
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return dict(N=total - embed, total=total, L=cfg.num_hidden_layers,
                hd=cfg.num_attention_heads * head_dim)  # fmt: skip


def flops(nums: dict, lengths: list[int], backward: bool) -> float:
    k = 6 if backward else 2
    return k * nums["N"] * sum(lengths) + k * nums["L"] * nums["hd"] * sum(s * s for s in lengths)


def bare_microbatches(mine, device):
    """The worker's microbatches as the bare step sees them: one packed row, position ids
    restarting per document, labels = tokens on the loss mask (-100 elsewhere, so no target
    crosses a document border)."""
    out = []
    for samples in mine:
        ids = [t for s in samples for t in s.token_ids]
        pos = [i for s in samples for i in range(len(s.token_ids))]
        labels = [t if m else -100 for s in samples for t, m in zip(s.token_ids, s.loss_mask,
                                                                     strict=True)]  # fmt: skip
        out.append(dict(
            input_ids=torch.tensor([ids], device=device),
            position_ids=torch.tensor([pos], device=device),
            labels=torch.tensor([labels], device=device),
            lengths=[len(s.token_ids) for s in samples],
        ))  # fmt: skip
    return out


# ------------------------------------------------------------------ steps


class Bare:
    """Bare AutoModel: forward with labels (the model's own cross-entropy over full fp32
    logits), backward, grad clip, AdamW."""

    def __init__(self, model, autocast_dtype, device):
        self.model, self.device = model, device
        self.autocast = autocast_dtype
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6,
                                     betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)  # fmt: skip
        self.attn = "sdpa"

    def _ctx(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, self.autocast)

    def step(self, mbs) -> float:
        self.model.train()
        set_attn(self.model, self.attn)
        n = len(mbs)
        for mb in mbs:
            set_documents(mb["lengths"], self.device)
            with self._ctx():
                out = self.model(input_ids=mb["input_ids"], position_ids=mb["position_ids"],
                                 labels=mb["labels"], use_cache=False)  # fmt: skip
            (out.loss / n).backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(norm)

    @torch.no_grad()
    def forward(self, mbs) -> None:
        self.model.eval()
        set_attn(self.model, self.attn)
        for mb in mbs:
            set_documents(mb["lengths"], self.device)
            with self._ctx():
                self.model(input_ids=mb["input_ids"], position_ids=mb["position_ids"],
                           use_cache=False)  # fmt: skip


def rl_algo(entropy_coef: float = 0.0):
    """The run config's loss settings as the loop passes them: PPO, token-mean."""
    from molt_train.config import AlgoConfig

    return AlgoConfig(aggregation="token-mean", entropy_coef=entropy_coef)


@contextlib.contextmanager
def rl_patch(worker, bf16_head=False, skip_entropy=False, attn=None, align=False):
    """Levers on the worker, as patches of molt_train.model_worker's and token_stats' globals
    (restored after). attn=None keeps the worker's own attention (molt_documents on GPU since
    the levers)."""
    import molt_train.model_worker as wm
    import molt_train.token_stats as ts

    orig_lp, orig_pack = ts.token_logprobs_and_entropy, wm.pack
    compute = wm.DTYPES[worker.cfg.dtype] if worker.on_gpu else torch.float32

    def logprobs(hidden, weight, targets, temperature, chunk_size, with_entropy):
        if bf16_head and hidden.dtype != compute:
            hidden, weight = hidden.to(compute), weight.to(compute)
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
}


def static_bytes(model, optimizer) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    if optimizer is not None:
        for state in optimizer.state.values():
            n += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    return n


class Timer:
    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu

    def sync(self):
        if self.on_gpu:
            torch.cuda.synchronize()

    def __call__(self, fn):
        """(seconds, step peak GB above what was allocated before, result)"""
        self.sync()
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        result = fn()
        self.sync()
        seconds = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if self.on_gpu else 0.0
        return seconds, peak, result


# ------------------------------------------------------------------ main benchmark


BARE_ATTN = {
    "bare": "sdpa",
    "bare+varlen": "molt_varlen",
    "bare+gqa": "molt_varlen_gqa",
    "bare+auto": "molt_auto",
}


def bare_variant(bares, name):
    """The bare model (one model, one optimizer) under another attention path."""
    if name not in bares:
        b = Bare.__new__(Bare)
        b.__dict__.update(bares["bare"].__dict__)
        b.attn = BARE_ATTN[name]
        bares[name] = b
    return bares[name]


def run_setting(args, ctx, seq_len: int, entropy_coef: float, variants: list[str]) -> None:
    from actor_gpu_smoke import random_samples

    from molt_train.packing import plan_microbatches

    worker, bares, timer, nums = ctx["worker"], ctx["bares"], ctx["timer"], ctx["nums"]
    vocab = worker.model.config.vocab_size
    count = max(1, args.tokens_per_step // seq_len)
    samples = random_samples(vocab, count, seq_len, seed=seq_len)
    plan = plan_microbatches(samples, args.max_tokens_per_microbatch, 1, worker.padded)
    mine = [[samples[i] for i in mb] for mb in plan[0]]
    lengths = [len(s.token_ids) for s in samples]
    tokens = sum(lengths)
    # forward-only log-probs (old policy / reference pass) vs a bare forward
    bare_mbs = bare_microbatches(mine, worker.device)
    fwd = {"rl-fwd": ("rl", None), "bare-fwd": (None, "bare")}
    for v in [x for x in args.fwd_variants.split(",") if x]:
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
    say(f"[{seq_len}] forward-only: " + "  ".join(f"{k} {v:.3f}s" for k, v in med.items())
        + f"  ratio(bare/rl time) {med['bare-fwd'] / med['rl-fwd']:.2f}")  # fmt: skip

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
        if name.startswith("rl"):
            steps[name] = rl_step(RL_VARIANTS[name])
        else:
            b = bare_variant(bares, name)
            steps[name] = lambda b=b: b.step(bare_mbs)
    times = {k: [] for k in steps}
    peaks = {k: 0.0 for k in steps}
    failed = {}
    ctx.pop("bare_auto_tok_s", None)
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
    base = None
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
        if name == "bare":
            base = tokens / t
        if name == "bare+auto":
            ctx["bare_auto_tok_s"] = tokens / t
        RESULTS["rows"].append(row)
    for row in RESULTS["rows"]:
        mine_row = row.get("setting") == str(seq_len) and row.get("entropy") == ent
        if mine_row and base and "tok_s" in row:
            row["ratio"] = row["tok_s"] / base
            if ctx.get("bare_auto_tok_s"):  # against the bare step with the same attention
                row["ratio_vs_bare_auto"] = row["tok_s"] / ctx["bare_auto_tok_s"]
    say(f"[{seq_len} entropy {ent}] " + "  ".join(
        f"{r['variant']} {r['s']:.3f}s {r['tok_s']:.0f}tok/s mfu {r['mfu']:.1%} "
        f"peak+{r['peak_gb']:.1f}GB ratio {r.get('ratio', float('nan')):.2f}"
        for r in RESULTS["rows"]
        if r.get("setting") == str(seq_len) and r.get("entropy") == ent and "s" in r
    ))  # fmt: skip
    ctx.setdefault("last", {})[seq_len] = (mine, num_tokens, num_sequences, bare_mbs, samples)


def correctness(args, ctx) -> None:
    """Packing isolates sequences under the new attention path too, and it agrees with SDPA's
    dense-mask path."""
    from actor_gpu_smoke import random_samples

    worker = ctx["worker"]
    vocab = worker.model.config.vocab_size
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


def gather_levers(args, ctx) -> None:
    """The refit gather against a bare state-dict loop casting to bf16, and prototypes."""
    from transformers.core_model_loading import revert_weight_conversion

    import molt_train.model_worker as wm

    worker, timer = ctx["worker"], ctx["timer"]
    model = worker.model
    bf16 = torch.bfloat16

    def worker_gather():
        return sum(t.numel() for _, t in worker.named_full_tensors(bf16))

    def bare_loop():
        return sum(v.detach().to(bf16).numel() for v in model.state_dict().values())

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

    res = {}
    for name, fn in [("named_full_tensors", worker_gather), ("bare_loop", bare_loop),
                     ("state_dict_only", state_dict_only), ("revert_only_per_tensor", revert_only),
                     ("loop_no_revert", no_revert), ("one_revert_call", one_revert),
                     ("foreach_copy_cast", foreach_cast)]:  # fmt: skip
        ts = []
        for _ in range(args.warmup + args.steps):
            s, _, _ = timer(fn)
            ts.append(s)
        res[name] = statistics.median(ts[args.warmup :])
    nbytes = sum(v.numel() for v in model.state_dict().values()) * 2
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
    for name in args.profile_variants.split(","):
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
    args = p.parse_args()
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
    sections = set(args.sections.split(","))
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
    bare = Bare(bare_model, torch.bfloat16 if on_gpu else None, worker.device)
    bare_varlen = Bare.__new__(Bare)
    bare_varlen.__dict__.update(bare.__dict__)
    bare_varlen.attn = "molt_varlen"
    say(f"bare built in {time.perf_counter() - t0:.1f}s: {type(bare_model).__name__}, "
        f"attn {bare_model.config._attn_implementation}")  # fmt: skip
    nums = model_numbers(worker.model)
    RESULTS.update(model=nums, torch=torch.__version__, device=torch.cuda.get_device_name() if on_gpu else "cpu",
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), args=vars(args))  # fmt: skip
    ctx = dict(worker=worker, bares={"bare": bare, "bare+varlen": bare_varlen}, timer=Timer(on_gpu),
               nums=nums)  # fmt: skip
    ctx["static_gb"] = dict(rl=static_bytes(worker.model, worker.optimizer) / 2**30)
    say("model numbers:", json.dumps(nums))
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
    ctx["static_gb"]["bare"] = static_bytes(bare.model, bare.opt) / 2**30
    RESULTS["static_gb"] = ctx["static_gb"]
    say("static (params + optimizer state) GB:", json.dumps(ctx["static_gb"]))
    for name, fn in [("correct", correctness), ("gather", gather_levers), ("logprob", logprob_levers),
                     ("host", host_levers)]:  # fmt: skip
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
    if "flex" in sections and on_gpu:
        flex_lever(args, ctx)
        dump(args.out)
    if "dtype" in sections and on_gpu:
        try:
            fsdp_mp_levers(args, ctx, args.default_seq_len)
        except Exception as error:
            say(f"dtype FAILED: {error!r}"[:400])
        dump(args.out)
    dump(args.out)
    say("RESULTS_JSON", json.dumps({k: RESULTS[k] for k in ("rows",)}, default=str)[:100])
    dist.barrier()
    worker.shutdown()


if __name__ == "__main__":
    main()
