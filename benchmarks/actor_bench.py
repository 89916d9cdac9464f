"""Shared parts of issue 12's trainer benchmark (actor_vs_automodel.py): the results and the
log, the FLOP count, the timer, the bare AutoModel step, and the attention prototypes both the
bare and the RL variants switch between by name (`set_attn`). The document lengths the
prototypes attend within come from the packed microbatch (`set_documents`), host side."""

import argparse
import contextlib
import inspect
import json
import os
import time

import torch
import torch.nn.functional as F

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
        os.makedirs(out_dir, exist_ok=True)
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
                hd=cfg.num_attention_heads * head_dim, vocab=cfg.vocab_size)  # fmt: skip


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


# ------------------------------------------------------------------ bare variants


BARE_ATTN = {
    "bare": "sdpa",
    "bare+varlen": "molt_varlen",
    "bare+gqa": "molt_varlen_gqa",
    "bare+auto": "molt_auto",
}


def resident(ctx, variant: str) -> bool:
    """Whether the variant's model is in memory in this phase (actor_vs_automodel's --resident)."""
    return ("rl" if variant.startswith("rl") else "bare") in ctx["resident"]


def bare_variant(bares, name):
    """The bare model (one model, one optimizer) under another attention path."""
    if name not in bares:
        b = Bare.__new__(Bare)
        b.__dict__.update(bares["bare"].__dict__)
        b.attn = BARE_ATTN[name]
        bares[name] = b
    return bares[name]
