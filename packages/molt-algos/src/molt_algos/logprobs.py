"""Per-token log-probabilities and entropy of the temperature-scaled distribution (the one vLLM
samples from) without full-vocabulary float32 tensors: the forward walks tokens in blocks and
keeps per-token values only; the backward recomputes each block's logits. On CUDA each block's
elementwise work runs compiled, so no float32 block is ever written to memory. The formulas and
the gradient derivation are in docs/algorithms.md ("Log-probabilities and entropy, chunked")."""

import functools
import math
from typing import NamedTuple

import torch
from torch import Tensor

# Tokens per block. At V = 151,936 one float32 block of logits is 1024 · V · 4 B ≈ 0.6 GB.
DEFAULT_CHUNK_SIZE = 1024
# The backward's vocabulary slices are a multiple of this many columns wide: 16 bytes of bf16,
# so cuBLAS gets aligned leading dimensions (odd widths fall back to align1 kernels, 0.2 s of
# an 8K-token step on an H200; docs/benchmarks.md, "Trainer parity on one H200").
SLICE_ALIGN = 8


def token_logprobs_and_entropy(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_ids: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    compute_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log π(y_t) and entropy H_t of softmax(W h_t / τ) for each token, computed in blocks.

    Args:
        hidden: [..., H] final hidden states (after the last norm), any float dtype.
        lm_head_weight: [V, H] output projection, same dtype and device as `hidden`.
        target_ids: [...] token ids in [0, V), same leading shape as `hidden`.
        temperature: τ > 0 that divides the logits.
        chunk_size: tokens per forward block; the backward pass walks the vocabulary in slices
            holding about the same number of logits (chunk_size · V / T columns for all T rows,
            rounded up to a multiple of SLICE_ALIGN).
        compute_entropy: when False, skip the entropy and return None in its place.

    Returns:
        (logprobs, entropy), float32 (float64 for float64 input) with shape [...]. Both carry
        gradients to `hidden` and `lm_head_weight` (whichever require them); the gradient of the
        weight is one matmul per vocabulary slice, so it is rounded to the weight's dtype once,
        like autograd's.
    """
    _check_temperature_and_chunk(temperature, chunk_size)
    if hidden.shape[-1] != lm_head_weight.shape[1] or lm_head_weight.dim() != 2:
        raise ValueError(
            f"hidden [..., {hidden.shape[-1]}] does not match lm_head_weight "
            f"{list(lm_head_weight.shape)} (expected [V, H])"
        )
    if hidden.dtype != lm_head_weight.dtype:
        raise ValueError(f"dtype mismatch: hidden {hidden.dtype}, weight {lm_head_weight.dtype}")
    if target_ids.shape != hidden.shape[:-1]:
        raise ValueError(f"target_ids {list(target_ids.shape)} vs hidden {list(hidden.shape)}")

    leading = target_ids.shape
    outputs = _HiddenLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        lm_head_weight,
        target_ids.reshape(-1).long(),
        float(temperature),
        int(chunk_size),
        compute_entropy,
    )
    return _shape_outputs(outputs, leading, compute_entropy)


def logprobs_from_logits(
    logits: Tensor,
    target_ids: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    compute_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log π(y_t) and entropy H_t of softmax(logits_t / τ), upcasting one block at a time.

    For callers that already hold the logits (in bf16, say): no float32 copy of the whole
    [..., V] tensor is ever made. The gradient of `logits` has its shape and dtype, as it would
    with autograd.

    Args:
        logits: [..., V] raw logits, any float dtype.
        target_ids: [...] token ids in [0, V).
        temperature: τ > 0 that divides the logits.
        chunk_size: tokens per block, in both the forward and the backward pass.
        compute_entropy: when False, skip the entropy and return None in its place.

    Returns:
        (logprobs, entropy), float32 (float64 for float64 input) with shape [...].
    """
    _check_temperature_and_chunk(temperature, chunk_size)
    if target_ids.shape != logits.shape[:-1]:
        raise ValueError(f"target_ids {list(target_ids.shape)} vs logits {list(logits.shape)}")

    leading = target_ids.shape
    outputs = _LogitsLogprobs.apply(
        logits.reshape(-1, logits.shape[-1]),
        target_ids.reshape(-1).long(),
        float(temperature),
        int(chunk_size),
        compute_entropy,
    )
    return _shape_outputs(outputs, leading, compute_entropy)


def _check_temperature_and_chunk(temperature: float, chunk_size: int) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _shape_outputs(
    outputs: Tensor | tuple[Tensor, Tensor], leading: torch.Size, compute_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    if compute_entropy:
        logprobs, entropy = outputs
        return logprobs.view(leading), entropy.view(leading)
    return outputs.view(leading), None


def _compute_dtype(x: Tensor) -> torch.dtype:
    """float32, or float64 for float64 input: never below float32, never a downcast."""
    return torch.promote_types(x.dtype, torch.float32)


def _fused(fn):
    """`fn` compiled by Inductor for CUDA tensors, eager elsewhere. Compiled, each elementwise
    pass over a block reads the low-precision logits once and keeps its float32 values in
    registers; eager, every step writes a float32 block to memory (docs/benchmarks.md, "The
    log-prob blocks compiled"). CPU runs eager, and nothing is compiled (or imported:
    torch.compile's first call costs seconds) until a CUDA tensor comes."""

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
    """Per-row terms a, c of ∂L/∂logits = p (a log p + c) + g 1[v = y] (docs/algorithms.md),
    fixed for the whole backward; `a` is None without an entropy gradient. `at_target`, the
    value at v = y computed in full precision from the saved log p, replaces the target column."""

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
    """∂L/∂logits for a block of raw logits [N, W], in their dtype.

    `target_cols` is each row's target column within the block; rows whose target falls outside
    it (a vocabulary slice) carry any out-of-range value and keep their computed value.
    """
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
    """Columns per backward vocabulary slice: as many logits as a forward block holds, rounded
    up to a multiple of SLICE_ALIGN (the whole vocabulary at most)."""
    width = math.ceil(chunk_size * vocab / max(n_tokens, 1))
    return min(vocab, -(-width // SLICE_ALIGN) * SLICE_ALIGN)


class _HiddenLogprobs(torch.autograd.Function):
    """Forward over token blocks; backward over vocabulary slices, recomputing the logits.

    Slicing the vocabulary in the backward pass means each slice of ∂L/∂W is one complete matmul
    over all tokens (no low-precision accumulation across blocks), while ∂L/∂h, only [T, H],
    is accumulated in float32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, compute_entropy):
        n_tokens = hidden.shape[0]
        lse = hidden.new_empty(n_tokens, dtype=_compute_dtype(hidden))
        logprobs = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if compute_entropy else None
        for start in range(0, n_tokens, chunk_size):
            rows = slice(start, start + chunk_size)
            lse[rows], logprobs[rows], block_entropy = _block_stats(
                hidden[rows] @ weight.T, targets[rows], temperature, compute_entropy
            )
            if compute_entropy:
                entropy[rows] = block_entropy

        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, targets, lse, logprobs, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return (logprobs, entropy) if compute_entropy else logprobs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy=None):
        hidden, weight, targets, lse, logprobs, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None
        k = _coefficients(grad_logprobs, grad_entropy, logprobs, entropy, ctx.temperature)
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        width = _slice_width(ctx.chunk_size, vocab, n_tokens)

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
    def forward(ctx, logits, targets, temperature, chunk_size, compute_entropy):
        n_tokens = logits.shape[0]
        lse = logits.new_empty(n_tokens, dtype=_compute_dtype(logits))
        logprobs = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if compute_entropy else None
        for start in range(0, n_tokens, chunk_size):
            rows = slice(start, start + chunk_size)
            lse[rows], logprobs[rows], block_entropy = _block_stats(
                logits[rows], targets[rows], temperature, compute_entropy
            )
            if compute_entropy:
                entropy[rows] = block_entropy

        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, targets, lse, logprobs, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return (logprobs, entropy) if compute_entropy else logprobs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy=None):
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
