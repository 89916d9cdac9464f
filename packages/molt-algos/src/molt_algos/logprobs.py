"""Per-token log-probs and entropy of vLLM's temperature-scaled distribution without full-vocabulary
float32 tensors: blocks forward, logits recomputed backward (docs/concepts/algorithms.md)."""

import functools
import math
from typing import NamedTuple

import torch
from torch import Tensor

# Tokens per block. At V = 151,936 one float32 block of logits is 1024 · V · 4 B ≈ 0.6 GB.
DEFAULT_CHUNK_SIZE = 1024
# The backward's vocabulary slices are a multiple of this many columns wide: 16 bytes of bf16,
# so cuBLAS gets aligned leading dimensions (odd widths fall back to slower align1 kernels:
# docs/performance.md).
SLICE_ALIGN = 8


def token_logprobs_and_entropy(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_ids: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    compute_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log pi(y_t) and entropy H_t of softmax(W h_t / temperature) per token from the final hidden
    states [..., H] and the LM head W [V, H]: float32 (float64 for float64 input), shape [...]."""
    if lm_head_weight.dim() != 2 or hidden.shape[-1] != lm_head_weight.shape[1]:
        weight = list(lm_head_weight.shape)
        raise ValueError(f"hidden [..., {hidden.shape[-1]}] does not match [V, H] weight {weight}")
    if hidden.dtype != lm_head_weight.dtype:
        raise ValueError(f"dtype mismatch: hidden {hidden.dtype}, weight {lm_head_weight.dtype}")
    inputs = (hidden, lm_head_weight)
    return _apply(_HiddenLogprobs, inputs, target_ids, temperature, chunk_size, compute_entropy)


def logprobs_from_logits(
    logits: Tensor,
    target_ids: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    compute_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """The same from logits the caller holds ([..., V], any float dtype), upcast one block of
    chunk_size tokens at a time in both passes: no float32 copy of the whole tensor."""
    return _apply(_LogitsLogprobs, (logits,), target_ids, temperature, chunk_size, compute_entropy)


def _apply(function, inputs, target_ids, temperature, chunk_size, compute_entropy):
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    leading = target_ids.shape
    if leading != inputs[0].shape[:-1]:
        raise ValueError(f"target_ids {list(leading)} vs inputs {list(inputs[0].shape)}")
    flat = inputs[0].reshape(-1, inputs[0].shape[-1])
    config = (float(temperature), int(chunk_size), compute_entropy)
    logprobs, entropy = function.apply(flat, *inputs[1:], target_ids.reshape(-1).long(), *config)
    return logprobs.view(leading), None if entropy is None else entropy.view(leading)


def _compute_dtype(x: Tensor) -> torch.dtype:  # float32, or float64 for float64 input
    return torch.promote_types(x.dtype, torch.float32)


def _fused(fn):
    """`fn` compiled by Inductor for CUDA tensors (float32 values stay in registers), else eager."""

    @functools.cache
    def compiled():
        # Not fullgraph: past dynamo's recompile limit a call runs eager instead of failing
        # (tests compile with fullgraph=True, so a graph break still fails there).
        return torch.compile(fn, dynamic=True)

    @functools.wraps(fn)  # the eager function stays reachable as call.__wrapped__
    def call(logits: Tensor, *args):
        return compiled()(logits, *args) if _compiles(logits) else fn(logits, *args)

    return call


def _compiles(logits: Tensor) -> bool:
    # A block of one row or column runs eager: Inductor specialises sizes 0 and 1, so each
    # such shape would be a graph of its own and count towards the recompile limit.
    return logits.is_cuda and min(logits.shape) > 1


@_fused
def _block_stats(
    logits: Tensor, targets: Tensor, temperature: float, compute_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(lse, log p of the targets, entropy) for a block of raw logits [N, V]."""
    z = logits.to(_compute_dtype(logits)) / temperature  # a fresh block: in place from here
    top = z.amax(dim=-1, keepdim=True)
    shifted = z.sub_(top)  # <= 0: no overflow in exp, and the entropy's terms stay small
    e = shifted.exp()
    total = e.sum(dim=-1)
    log_total = total.log()
    lse = top.squeeze(-1) + log_total
    target_logp = shifted.gather(1, targets[:, None]).squeeze(1) - log_total
    # H = -sum p log p = log S - sum e d / S, with d = z - max and S = sum e.
    entropy = log_total - e.mul_(shifted).sum(dim=-1) / total if compute_entropy else None
    return lse, target_logp, entropy


class _Coefficients(NamedTuple):
    """Per-row a, c of dL/dlogits = p (a log p + c) + g 1[v = y] (docs/concepts/algorithms.md);
    `a` None without an entropy gradient; `at_target` (from the saved log p): the target column."""

    a: Tensor | None
    c: Tensor
    at_target: Tensor

    def rows(self, rows: slice) -> "_Coefficients":
        return _Coefficients(*(None if x is None else x[rows] for x in self))


def _coefficients(grad_logprobs, grad_entropy, logprobs, entropy, temperature) -> _Coefficients:
    dtype = logprobs.dtype
    g = torch.zeros_like(logprobs) if grad_logprobs is None else grad_logprobs.to(dtype)
    g = g / temperature
    if grad_entropy is None:
        a, c = None, -g
        at_target = logprobs.exp() * c + g
    else:
        a = -grad_entropy.to(dtype) / temperature
        c = a * entropy - g
        at_target = logprobs.exp() * (a * logprobs + c) + g
    return _Coefficients(a, c, at_target)


@_fused
def _logit_grad(
    logits: Tensor, lse: Tensor, k: _Coefficients, target_cols: Tensor, temperature: float
) -> Tensor:
    """dL/dlogits of a block of raw logits [N, W], in their dtype; `target_cols`: each row's
    target column within the block (out of range where it lies in another vocabulary slice)."""
    logp = (logits.to(lse.dtype) / temperature).sub_(lse[:, None])  # fresh: in place from here
    if k.a is None:
        grad = logp.exp_().mul_(k.c[:, None])
    else:
        p = logp.exp()
        grad = logp.mul_(k.a[:, None]).add_(k.c[:, None]).mul_(p)
    grad = grad.to(logits.dtype)
    # A where() rather than a boolean index keeps the step free of device-to-host syncs.
    inside = (target_cols >= 0) & (target_cols < grad.shape[1])
    cols = target_cols.clamp(0, grad.shape[1] - 1)[:, None]
    kept = grad.gather(1, cols).squeeze(1)
    return grad.scatter_(1, cols, torch.where(inside, k.at_target.to(grad.dtype), kept)[:, None])


def _slice_width(chunk_size: int, vocab: int, n_tokens: int) -> int:
    """Columns per backward vocabulary slice: a forward block's logits, aligned, <= vocab."""
    width = math.ceil(chunk_size * vocab / max(n_tokens, 1))
    return min(vocab, -(-width // SLICE_ALIGN) * SLICE_ALIGN)


def _forward(ctx, block_logits, saved, targets, temperature, chunk_size, compute_entropy):
    """Log p of the targets and entropy (or None) over blocks; `block_logits(rows)`: raw logits."""
    lse = saved[0].new_empty(targets.shape[0], dtype=_compute_dtype(saved[0]))
    logprobs = torch.empty_like(lse)
    entropy = torch.empty_like(lse) if compute_entropy else None
    for start in range(0, targets.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        lse[rows], logprobs[rows], block_entropy = _block_stats(
            block_logits(rows), targets[rows], temperature, compute_entropy
        )
        if compute_entropy:
            entropy[rows] = block_entropy
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*saved, targets, lse, logprobs, entropy)
    ctx.temperature, ctx.chunk_size = temperature, chunk_size
    return logprobs, entropy


class _HiddenLogprobs(torch.autograd.Function):
    """Backward over vocabulary slices: each slice of dL/dW is one matmul over all tokens (no
    low-precision accumulation across blocks); dL/dh, only [T, H], accumulates in float32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, *config):
        return _forward(
            ctx, lambda rows: hidden[rows] @ weight.T, (hidden, weight), targets, *config
        )

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, logprobs, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None
        k = _coefficients(grad_logprobs, grad_entropy, logprobs, entropy, ctx.temperature)
        vocab = weight.shape[0]
        width = _slice_width(ctx.chunk_size, vocab, hidden.shape[0])
        grad_hidden = torch.zeros_like(hidden, dtype=lse.dtype) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        for start in range(0, vocab, width):
            cols = slice(start, start + width)
            grad = _logit_grad(hidden @ weight[cols].T, lse, k, targets - start, ctx.temperature)
            if need_weight:
                torch.mm(grad.T, hidden, out=grad_weight[cols])
            if need_hidden:
                grad_hidden += grad @ weight[cols]
            del grad  # before the next slice's allocations, not after them
        if need_hidden:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None


class _LogitsLogprobs(torch.autograd.Function):
    """Token blocks in both passes; only the logits themselves (the caller's) are kept."""

    @staticmethod
    def forward(ctx, logits, targets, *config):
        return _forward(ctx, lambda rows: logits[rows], (logits,), targets, *config)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, targets, lse, logprobs, entropy = ctx.saved_tensors
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None
        k = _coefficients(grad_logprobs, grad_entropy, logprobs, entropy, ctx.temperature)
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            grad_logits[rows] = _logit_grad(
                logits[rows], lse[rows], k.rows(rows), targets[rows], ctx.temperature
            )
        return grad_logits, None, None, None, None
