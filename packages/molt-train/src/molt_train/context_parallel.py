"""Context parallelism (`--fsdp.cp_size`): each rank runs the model on a window of the row."""

# docs/concepts/trainer.md, "Context parallelism".

# The row is padded to a multiple of C by one more (untrained) document; attention all-gathers
# K and V and runs the window's queries within their documents, causal aligned bottom-right
# (exact for any cut); per-position results are gathered back into the whole row.

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.distributed as dist
from torch import Tensor

from molt_train.attention import flash_attention
from molt_train.packing import PackedBatch, _to

CONTEXT_ATTENTION = "molt_context"


@dataclass(frozen=True)
class ContextShard:
    """This rank's place in its context-parallel group."""

    group: dist.ProcessGroup
    rank: int
    size: int


@dataclass(frozen=True)
class KeyLayout:
    """Which keys this window's queries see, per document piece."""

    shard: ContextShard
    key_start: int  # the first key any query here sees: its first document's start
    key_end: int  # the window's end: no query sees a later key
    pieces: list[tuple[int, int, int, int]]  # (query start, end, key start, end), local
    cu_q: Tensor  # [pieces + 1] int32 offsets of the pieces' queries in the window
    cu_k: Tensor  # [pieces + 1] int32 offsets of their keys from key_start
    max_q: int
    max_k: int


def window(batch: PackedBatch, shard: ContextShard) -> tuple[dict, Tensor]:
    """This rank's window of a packed row: the model's inputs (input_ids, position_ids, the
    attention's key layout) and [1, W] the token each position predicts (padding: 0)."""
    length = sum(batch.lengths)
    width = -(-length // shard.size)
    pad = width * shard.size - length
    ids = torch.nn.functional.pad(batch.input_ids, (0, pad))
    tail = torch.arange(pad, device=ids.device, dtype=batch.position_ids.dtype)[None]
    positions = torch.cat([batch.position_ids, tail], dim=1)
    targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))
    lo, hi = shard.rank * width, (shard.rank + 1) * width
    bounds = list(accumulate([0, *batch.lengths, pad]))  # the padding: one more document
    pieces = [
        (max(start, lo), min(end, hi), start, min(end, hi))
        for start, end in zip(bounds[:-1], bounds[1:], strict=True)
        if start < hi and end > lo
    ]
    key_start = pieces[0][2]
    local = [(qs - lo, qe - lo, ks - key_start, ke - key_start) for qs, qe, ks, ke in pieces]
    queries = [qe - qs for qs, qe, _, _ in local]
    keys = [ke - ks for _, _, ks, ke in local]

    def offsets(spans: list[int]) -> Tensor:  # from host ints: to a GPU without a sync
        return _to(torch.tensor([0, *spans]).cumsum(0, dtype=torch.int32), ids.device)

    cu_q, cu_k = offsets(queries), offsets(keys)
    layout = KeyLayout(shard, key_start, hi, local, cu_q, cu_k, max(queries), max(keys))
    inputs = dict(input_ids=ids[:, lo:hi], position_ids=positions[:, lo:hi], context_layout=layout)
    return inputs, targets[:, lo:hi]


def whole_row(per_position: Tensor, shard: ContextShard, length: int) -> Tensor:
    """[1, W, ...] of this rank's window -> [1, length - 1, ...] of the row, on every rank."""
    return _GatherWindows.apply(per_position, shard, 1, False)[:, : length - 1]


class _GatherWindows(torch.autograd.Function):
    """All-gather of each rank's window along `dim`."""

    # Backward: a reduce-scatter (`sum_grads`: K and V), else the rank's own slice (the loss,
    # the same on every rank).

    @staticmethod
    def forward(ctx, x: Tensor, shard: ContextShard, dim: int, sum_grads: bool) -> Tensor:
        ctx.shard, ctx.dim, ctx.sum_grads = shard, dim, sum_grads
        local = x.movedim(dim, 0).contiguous()
        out = local.new_empty((local.shape[0] * shard.size, *local.shape[1:]))
        dist.all_gather_into_tensor(out, local, group=shard.group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shard, dim = ctx.shard, ctx.dim
        grad = grad.movedim(dim, 0)
        width = grad.shape[0] // shard.size
        if ctx.sum_grads:
            grad = grad.contiguous()
            local = grad.new_empty((width, *grad.shape[1:]))
            dist.reduce_scatter_tensor(local, grad, group=shard.group)
        else:
            local = grad[shard.rank * width : (shard.rank + 1) * width]
        return local.movedim(0, dim), None, None, None


def context_attention(module, query, key, value, mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention interface, keys and values gathered from the whole row."""
    if kwargs.get("sliding_window") is not None:
        raise ValueError("context parallelism has no sliding-window attention")
    layout = kwargs["context_layout"]
    key, value = (_GatherWindows.apply(x, layout.shard, 2, True) for x in (key, value))
    key, value = (x[:, :, layout.key_start : layout.key_end] for x in (key, value))
    return local_attention(module, query, key, value, layout, dropout, scaling), None


def local_attention(module, query, key, value, layout: KeyLayout, dropout=0.0, scaling=None):
    """Each piece's queries against its document's keys, causal aligned bottom-right."""
    # Varlen FlashAttention on CUDA in 16 bits, else SDPA piece by piece (the reference).
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu, longest = (layout.cu_q, layout.cu_k), (layout.max_q, layout.max_k)
    out = flash_attention(query, key, value, cu, longest, scaling, dropout)
    if out is not None:
        return out
    outputs = []
    for qs, qe, ks, ke in layout.pieces:
        q_len, k_len = qe - qs, ke - ks
        rows = torch.arange(q_len, device=query.device)[:, None] + (k_len - q_len)
        mask = torch.arange(k_len, device=query.device)[None, :] <= rows
        q, k, v = query[:, :, qs:qe], key[:, :, ks:ke], value[:, :, ks:ke]
        out, _ = sdpa_attention_forward(
            module, q, k, v, mask[None, None], dropout=dropout, scaling=scaling, is_causal=False
        )
        outputs.append(out)
    return torch.cat(outputs, dim=1)
