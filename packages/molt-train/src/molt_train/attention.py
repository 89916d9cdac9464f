"""Causal attention within each document of a packed row, without a mask.

For a packed row (position ids restarting at 0) transformers builds a dense block-diagonal
[T, T] mask, which keeps SDPA off its causal kernels: cuDNN then computes the whole square
(about 8x the causal work for four 2K documents in an 8K row; docs/benchmarks.md, "Trainer
parity on one H200"). `document_attention` reads the documents' offsets that `pack` builds from
the host-side lengths (no device sync) and runs, per row:

- one document, or padded rows: SDPA's causal path, no mask;
- several documents on CUDA in 16 bits: torch's varlen FlashAttention over the offsets;
- otherwise (CPU, fp32): SDPA one document at a time, the reference the GPU path is tested
  against.

The name is not registered as a mask function, so transformers builds no mask at all for it
(nor runs its packed-sequence detection, a device sync).
"""

import inspect
from functools import cache

import torch
from torch import Tensor

DOCUMENT_ATTENTION = "molt_documents"


def document_kwargs(cu_seqlens: Tensor, lengths: list[int]) -> dict:
    """Model-call kwargs that carry a packed row's document offsets to the attention layers
    (transformers' names for them, which its models pass through to attention functions)."""
    longest = max(lengths)
    return dict(
        cu_seq_lens_q=cu_seqlens,
        cu_seq_lens_k=cu_seqlens,
        max_length_q=longest,
        max_length_k=longest,
    )


def enable_document_attention(model: torch.nn.Module) -> bool:
    """Route the model's SDPA attention through `document_attention`; False (and nothing
    changed) where the model attends through something else."""
    from transformers import AttentionInterface

    if model.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(DOCUMENT_ATTENTION, document_attention)
    model.config._attn_implementation = DOCUMENT_ATTENTION
    return True


def document_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention interface: q/k/v [B, H, T, D] in, [B, T, H, D] out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if sliding_window is not None:
        raise ValueError(f"{DOCUMENT_ATTENTION} attention has no sliding window")

    def sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out, _ = sdpa_attention_forward(
            module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True
        )
        return out

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or cu.numel() <= 2 or query.shape[0] != 1:
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


def flash_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu: tuple[Tensor, Tensor],
    longest: tuple[int, int],
    scale: float | None,
    dropout: float,
) -> Tensor | None:
    """`varlen_attention` on transformers' layout (q/k/v [1, H, T, D] in, [1, T, H, D] out),
    or None where FlashAttention does not apply: off CUDA, with dropout, or in 32 bits."""
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


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu: tuple[Tensor, Tensor], longest: tuple[int, int], scale
) -> Tensor:
    """torch's varlen FlashAttention, causal within each document: q [Tq, H, D], k/v [Tk, Hkv,
    D] -> [Tq, H, D]. `cu` and `longest`: the documents' offsets and longest length in q and
    in k. Where a document has fewer queries than keys (a context-parallel window), the causal
    mask is aligned bottom-right: its last query sees its last key."""
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
