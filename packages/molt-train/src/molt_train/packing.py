"""Token-budget packing of rollout segments into microbatches, and their split across ranks.

A microbatch is one row of concatenated sequences whose position ids restart at 0 for each one
(or, for native layers that ignore them, padded rows). Position t holds log p(token_ids[t] |
token_ids[:t]); position 0 carries 0.0. The layout, the attention it relies on and the
log-prob shift are explained in docs/training.md ("Packing").
"""

from dataclasses import dataclass
from dataclasses import field as dataclass_field

import numpy as np
import torch
from torch import Tensor

from molt_capture.media import ImageInput
from molt_train.routing_replay import microbatch_routing

# Sample fields carried per token into the loss, besides loss_mask.
TOKEN_FIELDS = (
    "advantages", "old_logprobs", "weights", "rollout_logprobs", "ref_logprobs", "returns",
    "old_values",
)  # fmt: skip


@dataclass
class Sample:
    """One token-exact sequence (a rollout segment) and its per-token training inputs."""

    token_ids: list[int]
    loss_mask: list[int]  # 1 where trained (generated tokens), aligned with token_ids
    temperature: float = 1.0
    advantages: list[float] | None = None  # per token (0 where masked)
    old_logprobs: list[float] | None = None  # proximal policy (recomputed by the trainer)
    weights: list[float] | None = None  # per-token IS-correction weights (1.0 default)
    # What the tokens were sampled with, when the training forward itself is the old policy
    # (no old_logprobs, no weights: the worker derives both; molt_train.experience)
    rollout_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None  # for a KL loss
    returns: list[float] | None = None  # critic targets (GAE); value model only
    old_values: list[float] | None = None
    # [tokens, layers, top_k] experts the engine routed each token to, -1 where it reported
    # none (--train.routing_replay; molt_train.routing_replay)
    routed_experts: np.ndarray | None = None
    # Per token, the sampler's top-k candidates and their log-probs ([] where not sampled):
    # --algo.score_centering (molt_algos.centering)
    head_ids: list[list[int]] | None = None
    head_logprobs: list[list[float]] | None = None
    # The processed images over the sequence's placeholder runs (a multimodal policy): the
    # engine's inputs, fed to the forward with the same ids.
    images: list[ImageInput] = dataclass_field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n == 0:
            raise ValueError("a Sample needs at least one token")
        if len(self.loss_mask) != n:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {n} tokens")
        for name in TOKEN_FIELDS:
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries for {n} tokens")
        if (self.head_ids is None) != (self.head_logprobs is None):
            raise ValueError("head_ids and head_logprobs come together")
        if self.head_ids is not None and self.head_logprobs is not None:
            if len(self.head_ids) != n or len(self.head_logprobs) != n:
                raise ValueError(f"head rows: {len(self.head_ids)} for {n} tokens")
            if any(
                len(a) != len(b) for a, b in zip(self.head_ids, self.head_logprobs, strict=True)
            ):
                raise ValueError("a head row has ids and log-probs of different lengths")
        if self.routed_experts is not None and len(self.routed_experts) != n:
            raise ValueError(f"routed_experts has {len(self.routed_experts)} rows for {n} tokens")
        if self.loss_mask[0]:
            raise ValueError("loss_mask[0] is 1, but the first token has no context to predict it")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    @property
    def num_trained(self) -> int:
        return sum(1 for m in self.loss_mask if m)


# ---------------------------------------------------------------- planning (indices only)


def pack_by_budget(lengths: list[int], max_tokens: int, padded: bool = False) -> list[list[int]]:
    """First-fit-decreasing: bins of indices costing at most `max_tokens`, the sum of their
    lengths (packed) or count × longest (padded rows). A sequence longer than the budget
    cannot be split (its tokens attend to each other), so it gets a bin of its own."""
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
    """Sample indices per data-parallel rank per microbatch: plan[rank][microbatch] = [i, ...].

    Samples are packed per temperature (one microbatch, one temperature: the log-prob function
    takes a scalar), microbatches are dealt to ranks largest first onto the rank with the
    fewest tokens, and every rank gets the same number of microbatches (FSDP's collectives run
    once per forward on every rank), padded with empty ones ([]).
    """
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
    """Put per-sample results (results[rank][microbatch][k] for plan[rank][microbatch][k])
    back into the samples' original order."""
    ordered: list = [None] * count
    for rank_plan, rank_results in zip(plan, results, strict=True):
        for mb, mb_results in zip(rank_plan, rank_results, strict=True):
            for i, result in zip(mb, mb_results, strict=True):
                ordered[i] = result
    return ordered


# ---------------------------------------------------------------- tensors of one microbatch


@dataclass
class PackedBatch:
    input_ids: Tensor  # [1, T] the sequences, concatenated; padded: [S, L]
    position_ids: Tensor  # [1, T] restarting at 0 for each sequence; padded: [S, L]
    row_index: Tensor  # [S, L] flat index into input_ids of each sequence's token t
    valid: Tensor  # [S, L] bool: t < the sequence's length
    loss_mask: Tensor  # [S, L] bool
    temperature: float
    lengths: list[int]
    fields: dict[str, Tensor | None]  # TOKEN_FIELDS as [S, L] float32; None where absent
    routing: Tensor | None = None  # [layers, input_ids.numel(), top_k] experts to replay
    # [S + 1] int32 offsets of the sequences in a packed row (0, n_0, n_0 + n_1, ...), for
    # document-masked attention (molt_train.attention); None for padded rows
    cu_seqlens: Tensor | None = None
    head_ids: Tensor | None = None  # [S, L, K] the sampler's candidates (0-padded)
    head_logprobs: Tensor | None = None  # [S, L, K] their log-probs (-inf pads)
    # The images' processor tensors for the forward (`pixel_values`, ...), empty for text
    images: dict[str, Tensor] = dataclass_field(default_factory=dict)

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    def to_rows(self, per_position: Tensor) -> Tensor:
        """Values shaped like input_ids -> [S, L] per sequence and token, 0 where padded."""
        flat = per_position.flatten()
        return torch.where(self.valid, flat[self.row_index], torch.zeros_like(flat[:1]))

    def to_lists(self, rows: Tensor, only_trained: bool = True) -> list[list[float]]:
        """[S, L] -> one list per sequence; 0.0 outside the loss mask when `only_trained`."""
        if only_trained:
            rows = torch.where(self.loss_mask, rows, torch.zeros_like(rows))
        values = rows.detach().float().cpu().tolist()
        return [row[:n] for row, n in zip(values, self.lengths, strict=True)]


def pack(
    samples: list[Sample], device: torch.device | str = "cpu", padded: bool = False
) -> PackedBatch:
    """One packed row of `samples` (all of one temperature), or one padded row each."""
    temperatures = {s.temperature for s in samples}
    if len(temperatures) != 1:
        raise ValueError(f"a microbatch needs one temperature, got {sorted(temperatures)}")
    lengths = [len(s.token_ids) for s in samples]
    width = max(lengths)
    offsets = torch.arange(width)
    valid = offsets[None, :] < torch.tensor(lengths)[:, None]
    if padded:
        input_ids = torch.tensor([s.token_ids + [0] * (width - len(s.token_ids)) for s in samples])
        position_ids = offsets.expand(len(samples), width)
        row_index = torch.arange(len(samples) * width).view(len(samples), width)
    else:
        input_ids = torch.tensor([[t for s in samples for t in s.token_ids]])
        position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
        starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
        row_index = torch.where(valid, starts[:, None] + offsets[None, :], 0)

    def rows(name: str) -> Tensor:
        return torch.tensor(
            [getattr(s, name) + [0] * (width - len(s.token_ids)) for s in samples],
            dtype=torch.float32,
        )

    fields_ = {}
    for name in TOKEN_FIELDS:
        present = [getattr(s, name) is not None for s in samples]
        if all(present):
            fields_[name] = _to(rows(name), device)
        elif any(present):
            raise ValueError(f"{name} is set on some samples of a batch but not on others")
        else:
            fields_[name] = None
    routing = None
    present = [s.routed_experts is not None for s in samples]
    if all(present):
        arrays = [s.routed_experts for s in samples]
        routing = _to(microbatch_routing(arrays, width if padded else None), device)
    elif any(present):
        raise ValueError("routed_experts is set on some samples of a batch but not on others")
    cu_seqlens = None
    if not padded:  # from the host-side lengths: building it costs the device no sync
        cu_seqlens = _to(torch.tensor([0, *lengths]).cumsum(0, dtype=torch.int32), device)
    head_ids, head_logprobs = _heads(samples, width)
    return PackedBatch(
        input_ids=_to(input_ids, device),
        position_ids=_to(position_ids, device),
        row_index=_to(row_index, device),
        valid=_to(valid, device),
        loss_mask=_to((rows("loss_mask") > 0) & valid, device),
        temperature=temperatures.pop(),
        lengths=lengths,
        fields=fields_,
        routing=routing,
        cu_seqlens=cu_seqlens,
        head_ids=None if head_ids is None else _to(head_ids, device),
        head_logprobs=None if head_logprobs is None else _to(head_logprobs, device),
        images={k: _to(v, device) for k, v in image_tensors(samples).items()},
    )


def _to(tensor: Tensor, device: torch.device | str) -> Tensor:
    """A host tensor on `device`. To a GPU through pinned memory, without waiting: a copy from
    pageable memory would make the host wait for the GPU's queue once per tensor. (Padded
    rows' position ids are an expanded view, which cannot be pinned as it is.)"""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.contiguous().pin_memory().to(device, non_blocking=True)


def image_tensors(samples: list[Sample]) -> dict[str, Tensor]:
    """The samples' images as the forward's keyword arguments, in the order their placeholder
    runs appear in the row(s): the model fills its image tokens in that order, over a packed
    row and over padded rows alike. Each tensor is flat over tiles ([tiles, ...]) per image;
    the model takes [1, images, ...] (Idefics3: an all-zero image is padding, none is here)."""
    images = [image for s in samples for image in s.images]
    if not images:
        return {}
    for s in samples:  # the model fills every placeholder id: each must be an image's
        placeholders = {s.token_ids[image.offset] for image in s.images}
        count = sum(1 for t in s.token_ids if t in placeholders)
        if count != sum(image.length for image in s.images):
            raise ValueError(f"{count} image placeholder tokens for images of "
                             f"{sum(image.length for image in s.images)} (one was sampled?)")  # fmt: skip
    return {
        name: torch.from_numpy(np.concatenate([i.tensors[name] for i in images]))[None]
        for name in images[0].tensors
    }


def _heads(samples: list[Sample], width: int) -> tuple[Tensor | None, Tensor | None]:
    """The samples' candidate heads as [S, width, K] tensors, K the longest head row."""
    present = [s.head_ids is not None for s in samples]
    if not any(present):
        return None, None
    if not all(present):
        raise ValueError("head_ids is set on some samples of a batch but not on others")
    k = max(1, max(len(row) for s in samples for row in s.head_ids))
    ids = torch.zeros(len(samples), width, k, dtype=torch.long)
    logprobs = torch.full((len(samples), width, k), -float("inf"))
    for i, s in enumerate(samples):
        for t, (row_ids, row_lps) in enumerate(zip(s.head_ids, s.head_logprobs, strict=True)):
            if row_ids:
                ids[i, t, : len(row_ids)] = torch.tensor(row_ids)
                logprobs[i, t, : len(row_lps)] = torch.tensor(row_lps)
    return ids, logprobs


def empty_batch(device: torch.device | str = "cpu", padded: bool = False) -> PackedBatch:
    """A two-token batch with nothing trained, for a rank with fewer real microbatches: it runs
    the same forward/backward collectives and contributes exactly zero loss and gradient."""
    return pack([Sample(token_ids=[0, 0], loss_mask=[0, 0])], device, padded)


def shift_right(per_position: Tensor | None) -> Tensor | None:
    """Values computed from each row's positions 0..T-2 (predicting tokens 1..T-1) -> aligned
    with the tokens they predict, [..., T], 0.0 at each row's position 0."""
    if per_position is None:
        return None
    return torch.nn.functional.pad(per_position, (1, 0))
