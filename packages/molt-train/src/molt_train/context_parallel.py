"""Context parallelism over packed rows (`--fsdp.cp_size C`): every rank of a CP group holds
the same microbatch and runs the model on one C-th of its packed row.

- The row is padded to a multiple of C (the padding is one more document, never trained) and
  cut into C contiguous windows; rank c runs the model on window c. Every layer but attention
  works token by token, and the position ids carry each token's place in its document.
- Each attention layer all-gathers K and V over the group (their gradients go back by a
  reduce-scatter) and runs this window's queries within their documents: a document's queries
  here see its keys from the document's start up to themselves, the keys ending where the
  queries end (causal, aligned bottom-right), which is exact for any cut.
- Per-position results (log-probs, entropy, values) are gathered back into the whole row, so
  every rank of the group computes the loss, its aggregation and the metrics exactly as
  without CP. All ranks then hold the same loss, so the gather's backward keeps the rank's own
  window of the gradient rather than summing the group's copies.

Why all-gather and not a ring: one collective per layer, K and V being a small share of the
activations under GQA, and no per-step mask bookkeeping. docs/training.md, "Context
parallelism".
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """Which keys this window's queries see, per document piece (host-side ints, and the
    offsets as tensors for the varlen kernel)."""

    shard: ContextShard
    key_start: int  # the first key any query here sees: its first document's start
    key_end: int  # the window's end: no query sees a later key
    pieces: list[tuple[int, int, int, int]]  # (query start, end, key start, end), local
    cu_q: Tensor  # [pieces + 1] int32 offsets of the pieces' queries in the window
    cu_k: Tensor  # [pieces + 1] int32 offsets of their keys from key_start
    max_q: int
    max_k: int


@dataclass
class Window:
    """A packed row's window on this rank: the model's inputs and the way back to the row."""

    inputs: dict  # input_ids, position_ids and the attention's key layout
    targets: Tensor  # [1, W] the token each window position predicts (padding: 0)
    shard: ContextShard
    length: int  # tokens in the unpadded row

    def whole(self, per_position: Tensor) -> Tensor:
        """[1, W, ...] values of this window -> [1, T - 1, ...] of the row's positions that
        predict a token (1..T-1), identical on every rank of the group."""
        row = _GatherWindows.apply(per_position, self.shard, 1, False)
        return row[:, : self.length - 1]


def window(batch: PackedBatch, shard: ContextShard) -> Window:
    """This rank's window of a packed row (`batch.cu_seqlens` set: not padded rows)."""
    if batch.cu_seqlens is None:
        raise ValueError("context parallelism needs packed rows")
    length = sum(batch.lengths)
    width = -(-length // shard.size)
    pad = width * shard.size - length
    ids = torch.nn.functional.pad(batch.input_ids, (0, pad))
    positions = batch.position_ids
    if pad:
        tail = torch.arange(pad, device=positions.device, dtype=positions.dtype)[None]
        positions = torch.cat([positions, tail], dim=1)
    targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))
    lo, hi = shard.rank * width, (shard.rank + 1) * width
    bounds = [0]
    for n in [*batch.lengths, pad] if pad else batch.lengths:
        bounds.append(bounds[-1] + n)
    pieces = [
        (max(start, lo), min(end, hi), start, min(end, hi))
        for start, end in zip(bounds[:-1], bounds[1:], strict=True)
        if start < hi and end > lo
    ]
    key_start = pieces[0][2]
    local = [(qs - lo, qe - lo, ks - key_start, ke - key_start) for qs, qe, ks, ke in pieces]

    def offsets(spans: list[int]) -> Tensor:  # from host ints: to a GPU without a sync
        return _to(torch.tensor([0, *spans]).cumsum(0, dtype=torch.int32), ids.device)

    layout = KeyLayout(
        shard=shard,
        key_start=key_start,
        key_end=hi,
        pieces=local,
        cu_q=offsets([qe - qs for qs, qe, _, _ in local]),
        cu_k=offsets([ke - ks for _, _, ks, ke in local]),
        max_q=max(qe - qs for qs, qe, _, _ in local),
        max_k=max(ke - ks for _, _, ks, ke in local),
    )
    inputs = dict(input_ids=ids[:, lo:hi], position_ids=positions[:, lo:hi], context_layout=layout)
    return Window(inputs, targets[:, lo:hi], shard, length)


class _GatherWindows(torch.autograd.Function):
    """All-gather of each rank's window along `dim`. Backward: a reduce-scatter (sum) where
    every rank used the gathered tensor differently (K and V), or the rank's own slice where
    every rank computed the same thing from it (the loss)."""

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


def enable_context_attention(model: torch.nn.Module) -> None:
    """Route the model's attention through `context_attention`; a clear error where the model
    does not attend through transformers' SDPA interface."""
    from transformers import AttentionInterface

    if model.config._attn_implementation != "sdpa":
        raise ValueError(
            "--fsdp.cp_size > 1 needs a model that attends through transformers' SDPA "
            f"interface; this one uses {model.config._attn_implementation!r}"
        )
    AttentionInterface.register(CONTEXT_ATTENTION, context_attention)
    model.config._attn_implementation = CONTEXT_ATTENTION


def context_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    context_layout: KeyLayout | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention interface: q/k/v [1, H, W, D] of this window in, [1, W, H, D]
    out, the keys and values gathered from the whole row."""
    if context_layout is None:
        raise ValueError(f"{CONTEXT_ATTENTION} attention runs only on a context-parallel window")
    if sliding_window is not None:
        raise ValueError("context parallelism has no sliding-window attention")
    layout = context_layout
    key, value = (_GatherWindows.apply(x, layout.shard, 2, True) for x in (key, value))
    key, value = (x[:, :, layout.key_start : layout.key_end] for x in (key, value))
    return local_attention(module, query, key, value, layout, dropout, scaling), None


def local_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    layout: KeyLayout,
    dropout: float = 0.0,
    scaling: float | None = None,
) -> Tensor:
    """Each piece's queries against its document's keys, causal and aligned bottom-right:
    q [1, H, W, D], k/v [1, Hkv, key_end - key_start, D] -> [1, W, H, D]. On CUDA in 16 bits
    one varlen FlashAttention call (its causal mask is bottom-right aligned); otherwise SDPA
    piece by piece with an explicit mask, the reference the GPU path is tested against."""
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
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, qs:qe],
            key[:, :, ks:ke],
            value[:, :, ks:ke],
            mask[None, None],
            dropout=dropout,
            scaling=scaling,
            is_causal=False,
        )
        outputs.append(out)
    return torch.cat(outputs, dim=1)
