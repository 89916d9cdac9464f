"""Per-token log-probabilities and entropy of the temperature-scaled distribution (the one vLLM
samples from) without full-vocabulary float32 tensors: the forward walks tokens in blocks and
keeps per-token values only; the backward recomputes each block's logits. The formulas and the
gradient derivation are in docs/algorithms.md ("Log-probabilities and entropy, chunked")."""

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


def _log_softmax(logits: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """(log softmax(logits / τ), lse) of a block [N, V] of any dtype, in float32 (float64)."""
    dtype = _compute_dtype(logits)
    if temperature == 1.0:
        # With dtype= the CUDA kernel reads bf16/fp16 and upcasts as it goes: no copy.
        logp = torch.log_softmax(logits, dim=-1, dtype=dtype)
    else:
        logp = torch.log_softmax(logits.to(dtype, copy=True).div_(temperature), dim=-1)
    # lse is read back at each row's maximum, where log p lies in [−log V, 0], so the
    # subtraction loses nothing; log_softmax is one fused kernel where logsumexp is several.
    top, argmax = logits.max(dim=-1)
    lse = top.to(dtype) / temperature - logp.gather(1, argmax[:, None]).squeeze(1)
    return logp, lse


def _block_stats(
    logits: Tensor, targets: Tensor, temperature: float, compute_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(lse, log p of the targets, entropy) for a block of raw logits [N, V]."""
    logp, lse = _log_softmax(logits, temperature)
    target_logp = logp.gather(1, targets[:, None]).squeeze(1)
    entropy = -logp.exp().mul_(logp).sum(dim=-1) if compute_entropy else None
    return lse, target_logp, entropy


def _log_probs(logits: Tensor, lse: Tensor, temperature: float) -> Tensor:
    """log p = logits / τ − lse for a block, as fresh float32 (float64) scratch."""
    if logits.device.type == "cuda":
        # CUDA kernels cast their inputs on the fly: upcast, scale and shift in one pass.
        return torch.add(-lse[:, None], logits, alpha=1.0 / temperature)
    # On CPU a mixed-dtype add would first make a float32 copy of its own; make it ours instead.
    z = logits.to(_compute_dtype(logits), copy=True)
    if temperature != 1.0:
        z.div_(temperature)
    return z.sub_(lse[:, None])


class _Coefficients(NamedTuple):
    """Per-row terms a, c of ∂L/∂logits = p (a log p + c) + g 1[v = y] (docs/algorithms.md),
    fixed for the whole backward; `a` is None without an entropy gradient. `at_target`, the
    value at v = y in full precision, overwrites the target column after bf16 rounding."""

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


def _logit_grad(logp: Tensor, k: _Coefficients, target_cols: Tensor, out: Tensor) -> Tensor:
    """∂L/∂logits for a block, written into `out` (input dtype); `logp` is scratch.

    `target_cols` is each row's target column within the block; rows whose target falls outside
    the block (a vocabulary slice) carry any out-of-range value and keep their computed value.
    """
    if k.a is None:
        torch.mul(logp.exp_(), k.c[:, None], out=out)
    else:
        p = logp.exp()
        torch.addcmul(k.c[:, None], logp, k.a[:, None], out=logp)  # a log p + c, in place
        torch.mul(logp, p, out=out)
    # A where() rather than a boolean index keeps the step free of device-to-host syncs.
    inside = (target_cols >= 0) & (target_cols < out.shape[1])
    cols = target_cols.clamp(0, max(out.shape[1] - 1, 0))[:, None]
    kept = out.gather(1, cols).squeeze(1)
    out.scatter_(1, cols, torch.where(inside, k.at_target.to(out.dtype), kept)[:, None])
    return out


def _slice_width(chunk_size: int, vocab: int, n_tokens: int) -> int:
    """Columns per backward vocabulary slice: as many logits as a forward block holds, rounded
    up to a multiple of SLICE_ALIGN (the whole vocabulary at most)."""
    width = math.ceil(chunk_size * vocab / max(n_tokens, 1))
    return min(vocab, -(-width // SLICE_ALIGN) * SLICE_ALIGN)


def _buffer_for(logp: Tensor, dtype: torch.dtype) -> Tensor:
    """Where a block's gradient goes: over log p itself when the dtypes agree."""
    return logp if logp.dtype == dtype else torch.empty_like(logp, dtype=dtype)


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
            logp = _log_probs(hidden @ weight[cols].T, lse, ctx.temperature)
            grad = _logit_grad(logp, k, targets - start, _buffer_for(logp, hidden.dtype))
            if need_weight:
                torch.mm(grad.T, hidden, out=grad_weight[cols])
            if need_hidden:
                grad_hidden += grad @ weight[cols]
            del logp, grad  # before the next slice's allocations, not after them
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
            logp = _log_probs(logits[rows], lse[rows], ctx.temperature)
            _logit_grad(logp, k.rows(rows), targets[rows], out=grad_logits[rows])
        return grad_logits, None, None, None, None
