"""One microbatch's forward: per-token log-probs (critic: values), entropy, candidates."""

# docs/concepts/trainer.md, "Log-probs". Results are [S, L] rows aligned with the token ids.

from __future__ import annotations

from typing import NamedTuple

import torch
from nemo_automodel.components.training.model_output_utils import get_final_hidden_states
from torch import Tensor
from torch.distributed.tensor import DTensor

from molt_algos.logprobs import logprobs_from_logits, token_logprobs_and_entropy
from molt_train.attention import DOCUMENT_ATTENTION, document_kwargs
from molt_train.context_parallel import whole_row, window
from molt_train.packing import PackedBatch


class TokenStats(NamedTuple):
    """Per-token results of one packed microbatch, as [S, L] rows aligned with token_ids."""

    logprobs: Tensor  # log-probs of the sampled tokens (values, for a critic)
    entropy: Tensor | None = None
    head_logprobs: Tensor | None = None  # [S, L, K] log-probs of the `head_ids` candidates


def packed_token_stats(
    model, batch, chunk, with_entropy, critic=False, from_hidden=True, shard=None
) -> TokenStats:
    """Log-probs at the batch's temperature (critic: values), entropy, and with the batch's
    `head_ids` the candidates' log-probs; with `shard`, from this rank's window of the row."""
    inputs = dict(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
    inputs.update(batch.images)  # a multimodal policy's pixel values; none for text
    if model.config._attn_implementation == DOCUMENT_ATTENTION and batch.cu_seqlens is not None:
        inputs.update(document_kwargs(batch.cu_seqlens, batch.lengths))
    targets = batch.input_ids[:, 1:]  # the tokens positions 0..T-2 predict
    if shard is not None:
        window_inputs, targets = window(batch, shard)
        inputs.update(window_inputs)

    def rows(per_position: Tensor | None) -> Tensor | None:
        """Predicting positions' values -> [S, L] rows of the tokens they predict."""
        if per_position is None:
            return None
        if shard is not None:
            per_position = whole_row(per_position, shard, sum(batch.lengths))
        return batch.to_rows(torch.nn.functional.pad(per_position, (1, 0)))

    predicting = targets.shape[1]  # the first positions of the model's output
    if critic:
        return TokenStats(rows(model(**inputs).logits[:, :predicting, 0].float()))
    if from_hidden and shard is None and batch.head_ids is None:
        # The LM head only where the loss reads a log-prob: an agent's prompts and tool
        # outputs, most of its rows, never reach it. Token p is predicted at position p - 1.
        hidden, weight = _final_hidden(model, inputs, batch.input_ids.shape[1])
        states = hidden.flatten(0, 1)[batch.trained - 1]
        trained_ids = batch.input_ids.flatten()[batch.trained]
        logprobs, entropy = token_logprobs_and_entropy(
            states, weight, trained_ids, batch.temperature, chunk, with_entropy
        )
        return TokenStats(*(v if v is None else batch.from_trained(v) for v in (logprobs, entropy)))
    if not from_hidden:
        # Under TP the LM head is vocabulary-sharded and its logits come out as a DTensor:
        # gather them (the gradient goes back to each rank's own vocabulary slice).
        logits = model(**inputs).logits
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        logprobs, entropy = logprobs_from_logits(
            logits[:, :predicting], targets, batch.temperature, chunk, with_entropy
        )
        return TokenStats(rows(logprobs), rows(entropy))
    hidden, weight = _final_hidden(model, inputs, predicting)
    logprobs, entropy = token_logprobs_and_entropy(
        hidden, weight, targets, batch.temperature, chunk, with_entropy
    )
    sampled = rows(logprobs)
    head = None if batch.head_ids is None else candidate_logprobs(hidden, weight, batch, sampled)
    return TokenStats(sampled, rows(entropy), head)


def _final_hidden(model: torch.nn.Module, inputs: dict, predicting: int) -> tuple[Tensor, Tensor]:
    """The predicting positions' final hidden states and the LM head's weight."""
    # The model projects one position only; the log-probs come from these block by block.
    # Under FSDP2 the LM head stays gathered after forward (AutoModel shards it with
    # reshard_after_forward=False), and FSDP reduces its gradient after backward.
    out = model(**inputs, output_hidden_states=True, logits_to_keep=1)
    # Every layer's states (transformers) or the final one (some native AutoModel classes).
    hidden, weight = get_final_hidden_states(out)[:, :predicting], model.lm_head.weight
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        # Autocast does not reach a custom Function's backward: cast here, as autocast would
        # for the model's own head, or the backward's GEMMs run in fp32 (docs/performance.md).
        compute = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(compute), weight.to(compute)
    return hidden, weight


def candidate_logprobs(hidden: Tensor, weight: Tensor, batch: PackedBatch, rows: Tensor) -> Tensor:
    """[S, L, K] log pi(j) = (z_j - z_y) / tau + log pi(y), z = h . W, y the sampled token."""
    # K rows of W per position, never the [T, V] logits: log pi(y) holds the logsumexp.
    states = torch.nn.functional.pad(hidden, (0, 0, 1, 0))  # position p: predicts token p
    states = states.reshape(-1, states.shape[-1])[batch.row_index].float()  # [S, L, H]
    weight = weight.float()
    sampled = batch.input_ids.flatten()[batch.row_index]
    z_sampled = (states * weight[sampled]).sum(-1)
    z_heads = torch.einsum("slh,slkh->slk", states, weight[batch.head_ids])
    head = (z_heads - z_sampled[..., None]) / batch.temperature + rows[..., None]
    return torch.where(batch.valid[..., None], head, torch.zeros_like(head))


def packs_sequences(model: torch.nn.Module) -> bool:
    """Whether restarting position ids isolate a packed row's sequences (transformers' mask)."""
    # Not in native layers that attend over the whole row, such as Qwen3-MoE's.
    native = any(c.__module__.startswith("nemo_automodel.") for c in type(model).__mro__)
    return not native or bool(getattr(model, "_uses_hf_attention", False))
