"""The forward pass of one packed microbatch: per-token log-probs (values, for a critic),
entropy and the sampler's candidates' log-probs, as [S, L] rows aligned with each sample's
token ids. molt_train.model_worker runs it for every forward and every training step."""

from __future__ import annotations

from typing import NamedTuple

import torch
from nemo_automodel.components.training.model_output_utils import get_final_hidden_states
from torch import Tensor
from torch.distributed.tensor import DTensor

from molt_algos.logprobs import logprobs_from_logits, token_logprobs_and_entropy
from molt_train.attention import DOCUMENT_ATTENTION, document_kwargs
from molt_train.context_parallel import ContextShard, window
from molt_train.packing import PackedBatch, shift_right


class TokenStats(NamedTuple):
    """Per-token results of one packed microbatch, as [S, L] rows aligned with token_ids."""

    logprobs: Tensor  # log-probs of the sampled tokens (values, for a critic)
    entropy: Tensor | None = None
    head_logprobs: Tensor | None = None  # [S, L, K] log-probs of the `head_ids` candidates


def packed_token_stats(
    model: torch.nn.Module,
    batch: PackedBatch,
    chunk_size: int,
    with_entropy: bool,
    critic: bool = False,
    from_hidden: bool = True,
    head_ids: Tensor | None = None,
    shard: ContextShard | None = None,
) -> TokenStats:
    """Per-token log-probs of the temperature-scaled distribution (values, for a critic) and
    entropy of one packed microbatch, as [S, L] rows aligned with each sample's token_ids;
    with `head_ids` [S, L, K] (from_hidden only), the log-probs of those candidates too.
    With `shard`, the model runs on this rank's window of the row (molt_train.context_parallel)
    and the results are the whole row's."""
    inputs = dict(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
    inputs.update(batch.images)  # a multimodal policy's pixel values; none for text
    if model.config._attn_implementation == DOCUMENT_ATTENTION and batch.cu_seqlens is not None:
        inputs.update(document_kwargs(batch.cu_seqlens, batch.lengths))
    targets = batch.input_ids[:, 1:]  # the tokens positions 0..T-2 predict
    part = None
    if shard is not None:
        if head_ids is not None:
            raise ValueError("candidate log-probs are not computed under context parallelism")
        part = window(batch, shard)
        inputs.update(part.inputs)
        targets = part.targets

    def rows(per_position: Tensor) -> Tensor:
        """Values of the predicting positions -> [S, L] rows (the whole row's, under CP)."""
        if part is not None:
            per_position = part.whole(per_position)
        return batch.to_rows(shift_right(per_position))

    predicting = targets.shape[1]  # the first positions of the model's output
    if critic:
        values = model(**inputs).logits[:, :predicting, 0].float()
        return TokenStats(rows(values))
    head = None
    if from_hidden:
        # Project only one position in the model; log-probs come from the final hidden states
        # block by block, never holding [T, V] logits. Under FSDP2 the LM head stays gathered
        # after forward (AutoModel shards it with reshard_after_forward=False), so its weight
        # here is the full compute-dtype tensor, and FSDP reduces its gradient after backward.
        out = model(**inputs, output_hidden_states=True, logits_to_keep=1)
        # A tuple of every layer's states (transformers) or only the final one (some native
        # AutoModel classes, e.g. Qwen3-MoE): AutoModel's helper reads either.
        hidden, weight = get_final_hidden_states(out)[:, :predicting], model.lm_head.weight
        device = hidden.device.type
        if torch.is_autocast_enabled(device):
            # Autocast does not reach a custom Function's backward: cast here, as autocast would
            # for the model's own head, or the backward's GEMMs run in fp32 (0.5 s of a 1.7 s
            # step on an H200). No-op on CPU, which runs without autocast.
            compute = torch.get_autocast_dtype(device)
            hidden, weight = hidden.to(compute), weight.to(compute)
        logprobs, entropy = token_logprobs_and_entropy(
            hidden, weight, targets, batch.temperature, chunk_size, with_entropy
        )
        sampled = rows(logprobs)
        if head_ids is not None:
            head = candidate_logprobs(hidden, weight, batch, sampled, head_ids)
    else:
        if head_ids is not None:
            raise ValueError("candidate log-probs need the hidden-state path (no TP, no EP)")
        # Under TP the LM head is vocabulary-sharded and its logits come out as a DTensor:
        # gather them (the gradient goes back to each rank's own vocabulary slice).
        logits = model(**inputs).logits
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        logprobs, entropy = logprobs_from_logits(
            logits[:, :predicting], targets, batch.temperature, chunk_size, with_entropy
        )
        sampled = rows(logprobs)
    return TokenStats(sampled, None if entropy is None else rows(entropy), head)


def candidate_logprobs(
    hidden: Tensor, weight: Tensor, batch: PackedBatch, rows: Tensor, head_ids: Tensor
) -> Tensor:
    """[S, L, K] log pi(j) of candidate ids at each position, from the hidden states
    [R, T-1, H] (one packed row, or padded rows) that predict tokens 1..T-1 and the sampled
    tokens' log-probs `rows` [S, L]: log pi(j) = (z_j - z_y) / tau + log pi(y), z = h . W.
    It needs K rows of W per position, never the [T, V] logits (log pi(y) holds the
    logsumexp)."""
    states = torch.nn.functional.pad(hidden, (0, 0, 1, 0))  # position p: predicts token p
    states = states.reshape(-1, states.shape[-1])[batch.row_index].float()  # [S, L, H]
    weight = weight.float()
    sampled = batch.input_ids.flatten()[batch.row_index]
    z_sampled = (states * weight[sampled]).sum(-1)
    z_heads = torch.einsum("slh,slkh->slk", states, weight[head_ids])
    head = (z_heads - z_sampled[..., None]) / batch.temperature + rows[..., None]
    return torch.where(batch.valid[..., None], head, torch.zeros_like(head))


def packs_sequences(model: torch.nn.Module) -> bool:
    """Whether restarting position ids isolate the sequences of a packed row: they do where
    transformers' mask code builds the attention mask (transformers classes, and native
    AutoModel classes that dispatch attention through it). Other native layers (Qwen3-MoE,
    for one) attend causally over the whole row: those microbatches are padded rows."""
    native = any(c.__module__.startswith("nemo_automodel.") for c in type(model).__mro__)
    return not native or bool(getattr(model, "_uses_hf_attention", False))
