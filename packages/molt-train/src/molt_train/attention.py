"""Causal attention within each document of a packed row, with no mask built."""

# torch's varlen FlashAttention over the offsets `pack` builds from host-side lengths on CUDA
# in 16 bits; SDPA one document at a time elsewhere, the reference the GPU path is tested against.

import inspect
from functools import cache

import torch
from torch import Tensor

DOCUMENT_ATTENTION = "molt_documents"


def document_kwargs(cu_seqlens: Tensor, lengths: list[int]) -> dict:
    """A packed row's document offsets as the kwargs transformers passes to attention."""
    n = max(lengths)
    return dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=n, max_length_k=n)


def route_sdpa(model: torch.nn.Module, name: str, attention) -> bool:
    """Route the model's SDPA attention through `attention`; False where it has no SDPA."""
    # Registered as no mask function: transformers builds no mask for it.
    from transformers import AttentionInterface

    if model.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(name, attention)
    model.config._attn_implementation = name
    return True


def document_attention(module, query, key, value, mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention interface: q/k/v [B, H, T, D] in, ([B, T, H, D], None) out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{DOCUMENT_ATTENTION} attention has no sliding window")

    def sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        causal = dict(dropout=dropout, scaling=scaling, is_causal=True)
        return sdpa_attention_forward(module, q, k, v, None, **causal)[0]

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or cu.numel() <= 2 or query.shape[0] != 1:  # one document, or padded rows
        return sdpa(query, key, value), None
    longest = kwargs["max_length_q"]
    out = flash_attention(query, key, value, (cu, cu), (longest, longest), scaling, dropout)
    if out is not None:
        return out, None
    bounds = cu.tolist()  # a host copy on CPU; one device sync on the rare GPU fallback
    pieces = [
        sdpa(*(x[:, :, start:end] for x in (query, key, value)))
        for start, end in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(pieces, dim=1), None


def flash_attention(query, key, value, cu, longest, scale, dropout) -> Tensor | None:
    """`varlen_attention` on q/k/v [1, H, T, D]; None off CUDA, with dropout or in 32 bits."""
    if not query.is_cuda or dropout:
        return None
    # Under autocast q/k leave the fp32 norms and RoPE in fp32; SDPA is on autocast's list
    # and casts them itself, FlashAttention takes 16-bit inputs only.
    autocast = torch.is_autocast_enabled("cuda")
    dtype = torch.get_autocast_dtype("cuda") if autocast else query.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    q, k, v = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))  # [T, H, D]
    return varlen_attention(q, k, v, cu, longest, scale)[None]


@cache
def _varlen_params() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu, longest, scale) -> Tensor:
    """torch's varlen FlashAttention, causal (bottom-right) within each document."""
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    # torch 2.11 spells causal as a window of (-1, 0); a later one may take is_causal.
    extra: dict = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "scale" in params:
        extra["scale"] = scale
    if "enable_gqa" in params:
        extra["enable_gqa"] = k.shape[1] != q.shape[1]
    elif k.shape[1] != q.shape[1]:  # without the flag, K/V need the query's head count
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return varlen_attn(q, k, v, *cu, *longest, **extra)
