"""Samples packed into microbatches, split across ranks, and one microbatch's tensors."""

# docs/concepts/trainer.md, "Packing": a packed row (position ids restarting at 0 for each
# sequence) or padded rows.

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass, replace

import numpy as np
import torch
from torch import Tensor

from molt_algos.objective import TokenInputs
from molt_capture.media import ImageInput
from molt_train.routing_replay import microbatch_routing

# The objective's per-token inputs a Sample carries besides its loss mask (the sampler's head
# comes as head_ids / head_logprobs).
TOKEN_FIELDS = [
    f.name for f in fields(TokenInputs) if f.name not in ("mask", "sampler_head_logprobs")
]


@dataclass
class Sample:
    """A rollout segment's tokens and training inputs, an array (or list) entry per token."""

    token_ids: np.ndarray
    loss_mask: np.ndarray  # 1 where trained (generated tokens)
    temperature: float = 1.0
    advantages: np.ndarray | None = None  # 0 where masked
    old_logprobs: np.ndarray | None = None  # proximal policy (recomputed by the trainer)
    weights: np.ndarray | None = None  # IS-correction weights (1.0 default)
    # What the tokens were sampled with, when the training forward itself is the old policy
    # (no old_logprobs, no weights: the objective derives both; molt_train.experience)
    rollout_logprobs: np.ndarray | None = None
    ref_logprobs: np.ndarray | None = None  # for a KL loss
    returns: np.ndarray | None = None  # critic targets (GAE); value model only
    old_values: np.ndarray | None = None
    # [tokens, layers, top_k] experts the engine routed each token to, -1 where it reported
    # none (--train.routing_replay; molt_train.routing_replay)
    routed_experts: np.ndarray | None = None
    # Per token, the sampler's top-k candidates and their log-probs ([] where not sampled):
    # --algo.score_centering (molt_algos.centering)
    head_ids: list[list[int]] | None = None
    head_logprobs: list[list[float]] | None = None
    # The processed images over the sequence's placeholder runs (a multimodal policy): the
    # engine's inputs, fed to the forward with the same ids.
    images: list[ImageInput] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", *TOKEN_FIELDS, "routed_experts", "head_ids", "head_logprobs"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries for {n} tokens")
        if (self.head_ids is None) != (self.head_logprobs is None):
            raise ValueError("head_ids and head_logprobs come together")
        if self.loss_mask[0]:
            raise ValueError("loss_mask[0] is 1, but the first token has no context to predict it")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    @property
    def num_trained(self) -> int:
        return int(np.count_nonzero(self.loss_mask))


# ---------------------------------------------------------------- planning (indices only)


def pack_by_budget(lengths: list[int], max_tokens: int, padded: bool = False) -> list[list[int]]:
    """First-fit-decreasing bins of indices costing at most `max_tokens` each."""
    # The cost: the sum of lengths (packed) or count x longest (padded rows). A sequence over
    # the budget cannot be split (its tokens attend to each other): a bin of its own.
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, members in enumerate(bins):
            # Decreasing order: a bin's first member is its longest.
            cost = (len(members) + 1) * lengths[members[0]] if padded else used[b] + lengths[i]
            if cost <= max_tokens:
                members.append(i)
                used[b] += lengths[i]
                break
        else:
            bins.append([i])
            used.append(lengths[i])
    return bins


def plan_microbatches(
    samples: list[Sample], max_tokens: int, dp_size: int, padded: bool = False
) -> list[list[list[int]]]:
    """plan[rank][microbatch] = [sample index, ...]."""
    # Packed per temperature (the log-prob function takes a scalar), dealt largest first onto
    # the rank with the fewest tokens; every rank gets the same number of microbatches (FSDP's
    # collectives), padded with empty ones ([]).
    by_temperature: dict[float, list[int]] = {}
    for i, sample in enumerate(samples):
        by_temperature.setdefault(sample.temperature, []).append(i)
    microbatches: list[list[int]] = []
    for indices in by_temperature.values():
        lengths = [len(samples[i].token_ids) for i in indices]
        bins = pack_by_budget(lengths, max_tokens, padded)
        microbatches += [[indices[j] for j in b] for b in bins]

    def tokens(mb: list[int]) -> int:
        return sum(len(samples[i].token_ids) for i in mb)

    per_rank = -(-len(microbatches) // dp_size)  # ceil
    plan: list[list[list[int]]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for mb in sorted(microbatches, key=tokens, reverse=True):
        rank = min((r for r in range(dp_size) if len(plan[r]) < per_rank), key=lambda r: load[r])
        plan[rank].append(mb)
        load[rank] += tokens(mb)
    for rank_plan in plan:
        rank_plan += [[] for _ in range(per_rank - len(rank_plan))]
    return plan


def unplan(plan: list[list[list[int]]], results: list[list[list]], count: int) -> list:
    """results[rank][microbatch][k] of plan[rank][microbatch][k], in the samples' order."""
    ordered: list = [None] * count
    for rank_plan, rank_results in zip(plan, results, strict=True):
        for mb, mb_results in zip(rank_plan, rank_results, strict=True):
            for i, result in zip(mb, mb_results, strict=True):
                ordered[i] = result
    return ordered


# ---------------------------------------------------------------- tensors of one microbatch


@dataclass
class PackedBatch:
    """One microbatch: the model's inputs and the objective's per-token ones."""

    input_ids: Tensor  # [1, T] the sequences, concatenated; padded: [S, L]
    position_ids: Tensor  # [1, T] restarting at 0 for each sequence; padded: [S, L]
    row_index: Tensor  # [S, L] flat index into input_ids of each sequence's token t
    valid: Tensor  # [S, L] bool: t < the sequence's length
    inputs: TokenInputs  # [S, L] per token: the loss mask, advantages, ... (molt_algos)
    temperature: float
    lengths: list[int]
    trained: Tensor  # [N] flat index into input_ids of the trained tokens, in row order
    routing: Tensor | None = None  # [layers, input_ids.numel(), top_k] experts to replay
    # [S + 1] int32 offsets of the sequences in a packed row (0, n_0, n_0 + n_1, ...), for
    # document-masked attention (molt_train.attention); None for padded rows
    cu_seqlens: Tensor | None = None
    head_ids: Tensor | None = None  # [S, L, K] the sampler's candidates (0-padded)
    # The images' processor tensors for the forward (`pixel_values`, ...), empty for text
    images: dict[str, Tensor] = field(default_factory=dict)

    def to_rows(self, per_position: Tensor) -> Tensor:
        """Values shaped like input_ids -> [S, L] per sequence and token, 0 where padded."""
        flat = per_position.flatten()
        return torch.where(self.valid, flat[self.row_index], torch.zeros_like(flat[:1]))

    def from_trained(self, values: Tensor) -> Tensor:
        """[N] values of the trained tokens, in row order -> [S, L] rows, 0 elsewhere."""
        out = torch.zeros(self.valid.shape, dtype=values.dtype, device=values.device)
        return out.masked_scatter(self.inputs.mask, values)

    def per_sample(self, rows: Tensor) -> list[np.ndarray]:
        """[S, L] -> one float32 array per sequence, 0.0 off the loss mask (a host read)."""
        values = torch.where(self.inputs.mask, rows.detach().float(), 0.0).cpu().numpy()
        return [row[:n] for row, n in zip(values, self.lengths, strict=True)]


def pack(
    samples: list[Sample], device: torch.device | str = "cpu", padded: bool = False
) -> PackedBatch:
    """One packed row of `samples` (all of one temperature), or one padded row each; no samples:
    a batch that trains nothing (a rank short of microbatches runs the same collectives)."""
    samples = samples or [Sample(token_ids=[0, 0], loss_mask=[0, 0])]
    temperatures = {s.temperature for s in samples}
    if len(temperatures) != 1:
        raise ValueError(f"a microbatch needs one temperature, got {sorted(temperatures)}")
    lengths = [len(s.token_ids) for s in samples]
    width = max(lengths)
    valid = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    ids = padded_rows([s.token_ids for s in samples], width, torch.long)
    positions = torch.arange(width).expand(valid.shape)
    if padded:
        index, offsets = torch.arange(ids.numel()).view(ids.shape), None
    else:  # the offsets from the host-side lengths: building them costs the device no sync
        ids, positions = ids[valid][None], positions[valid][None]
        index = torch.where(valid, valid.flatten().cumsum(0).view(valid.shape) - 1, 0)
        offsets = torch.tensor([0, *lengths]).cumsum(0, dtype=torch.int32)
    per_token = {}
    for name in TOKEN_FIELDS:
        values = _given(samples, name)
        per_token[name] = None if values is None else padded_rows(values, width, torch.float32)
    mask = padded_rows([s.loss_mask for s in samples], width, torch.bool)
    heads, head_logprobs = _heads(samples, width)
    routing = _given(samples, "routed_experts")
    if routing is not None:
        routing = microbatch_routing(routing, width if padded else None)
    inputs = TokenInputs(mask, **per_token, sampler_head_logprobs=head_logprobs)
    temperature, images = temperatures.pop(), _images(samples)
    # The trained tokens' positions, selected here on the host: on the device it would wait.
    batch = PackedBatch(ids, positions, index, valid, inputs, temperature, lengths, index[mask])
    batch = replace(batch, routing=routing, cu_seqlens=offsets, head_ids=heads, images=images)
    return _to(batch, device)


def _to(value, device: torch.device | str):
    """A host tensor (or those of a dict or dataclass) on `device`, without waiting."""
    # To a GPU through pinned memory: from pageable memory each copy makes the host wait.
    if is_dataclass(value):
        moved = {f.name: _to(getattr(value, f.name), device) for f in fields(value)}
        return replace(value, **moved)
    if isinstance(value, dict):
        return {name: _to(tensor, device) for name, tensor in value.items()}
    if not isinstance(value, Tensor):
        return value
    if torch.device(device).type != "cuda":
        return value.to(device)
    return value.contiguous().pin_memory().to(device, non_blocking=True)


def padded_rows(values: list, width: int, dtype: torch.dtype) -> Tensor:
    """Per-sample arrays (or lists) -> [S, width] rows, 0 past each one's end."""
    out = torch.zeros(len(values), width, dtype=dtype)
    # Written through numpy: arrays from Ray's object store are read-only, which torch warns of.
    for row, value in zip(out.numpy(), values, strict=True):
        row[: len(value)] = value
    return out


def _given(samples: list[Sample], name: str) -> list | None:
    """Every sample's `name`, or None where no sample has one."""
    values = [getattr(s, name) for s in samples]
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise ValueError(f"{name} is set on some samples of a batch but not on others")
    return values


def _images(samples: list[Sample]) -> dict[str, Tensor]:
    """The forward's image kwargs, [1, tiles, ...] in the order the model fills them in."""
    images = [image for s in samples for image in s.images]
    if not images:
        return {}
    for s in samples:  # the model fills every placeholder id: each must be an image's
        ids = np.asarray(s.token_ids)
        count = int(np.isin(ids, ids[[image.offset for image in s.images]]).sum())
        if count != (expected := sum(image.length for image in s.images)):
            raise ValueError(
                f"{count} image placeholder tokens for images of {expected} (one was sampled?)"
            )
    return {
        name: torch.from_numpy(np.concatenate([i.tensors[name] for i in images]))[None]
        for name in images[0].tensors
    }


def _heads(samples: list[Sample], width: int) -> tuple[Tensor | None, Tensor | None]:
    """The sampler's heads as [S, width, K] ids (0-padded) and log-probs (-inf pads)."""
    if _given(samples, "head_ids") is None:
        return None, None
    k = max(1, max(len(row) for s in samples for row in s.head_ids))
    ids = torch.zeros(len(samples), width, k, dtype=torch.long)
    logprobs = torch.full((len(samples), width, k), -float("inf"))
    for i, s in enumerate(samples):
        for t, (row_ids, row_lps) in enumerate(zip(s.head_ids, s.head_logprobs, strict=True)):
            ids[i, t, : len(row_ids)] = torch.as_tensor(row_ids, dtype=torch.long)
            logprobs[i, t, : len(row_lps)] = torch.as_tensor(row_lps, dtype=torch.float32)
    return ids, logprobs
