"""The records every later package exchanges: a generation, a token-exact segment, a rollout.
Every per-token list is aligned 1:1 with `token_ids`; they pickle (Ray) and round-trip JSON."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

from .media import ImageInput

PROMPT_VERSION = -1  # weight version recorded for tokens the policy did not sample

# One token's routed experts: a row of expert ids per MoE layer.
RoutingRow = list[list[int]]


@dataclass
class SamplingParams:
    """What the generator is asked for; the server fills it from the request and session."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    # Prompt positions whose routed experts the caller already holds: the engine reports rows
    # from this position on (ignored when it reports no routing).
    routing_start: int = 0
    seed: int | None = None  # the request's own sampling seed; None: the engine's RNG


def derive_seed(*keys: object) -> int:
    """A 31-bit seed that is a function of `keys` alone (no per-process hash salt)."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") >> 1


@dataclass
class Generation:
    """One engine answer: the sampled tokens, each with its log-prob and weight version."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"
    weight_versions: list[int]
    # A row per position the engine ran from the request's `routing_start` on: the rest of the
    # prompt and every sampled token but the last (never run), in sequence order.
    routed_experts: list[RoutingRow] | None = None
    routing_start: int = 0
    # The stop string (or stop token id) that ended generation, when one did (vLLM's stop_reason).
    stop_reason: str | int | None = None
    # Per sampled token, the engine's top-k candidates (ids, log-probs as sampled), when asked.
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None

    def __post_init__(self) -> None:
        n, ids, logprobs = len(self.token_ids), self.top_ids, self.top_logprobs
        if len(self.logprobs) != n or len(self.weight_versions) != n:
            counts = f"{n} ids, {len(self.logprobs)} logprobs, {len(self.weight_versions)}"
            raise ValueError(f"Generation lists are misaligned: {counts} weight versions")
        if (ids is None) != (logprobs is None):
            raise ValueError("Generation: top_ids and top_logprobs come together")
        if ids is not None and logprobs is not None:
            if len(ids) != n or len(logprobs) != n:
                rows = f"{len(ids)} / {len(logprobs)} top-k rows"
                raise ValueError(f"Generation: {n} tokens but {rows}")
            if any(len(a) != len(b) for a, b in zip(ids, logprobs, strict=True)):
                raise ValueError("Generation: a top-k row's ids and log-probs differ in length")
        if self.routed_experts is not None and len(self.routed_experts) < n - 1:
            rows = f"{n} ids but {len(self.routed_experts)} routing rows"
            raise ValueError(f"Generation has {rows}: every sampled token but the last was run")


@dataclass
class TurnSpan:
    start: int  # index of the first generated token
    end: int  # one past the last generated token
    max_tokens: int
    finish_reason: str


@dataclass
class Segment:
    """One token-exact context: exactly the ids the engine saw and produced, in order."""

    token_ids: list[int] = field(default_factory=list)
    trainable: list[int] = field(default_factory=list)  # 1 for generated tokens, else 0
    logprobs: list[float] = field(default_factory=list)  # as sampled; 0.0 where not generated
    weight_versions: list[int] = field(default_factory=list)  # PROMPT_VERSION where not generated
    # Per position, the experts the engine routed it to; None where the engine has not run it
    # (yet). None as a whole: the engine reports no routing.
    routed_experts: list[RoutingRow | None] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    truncated: bool = False  # the context filled up: the episode was cut, not finished
    turns: list[TurnSpan] = field(default_factory=list)
    # Per position, the engine's top-k candidates of a sampled token ([] elsewhere); None as a
    # whole: the engine reported none (score centering asks for them).
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # The images in the context, in order, each over its run of placeholder ids (multimodal
    # models only; molt_capture.media): what the engine and the trainer both get with the ids.
    images: list[ImageInput] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def append_context(self, ids: list[int], images: list[ImageInput] = ()) -> None:
        """Tokens the policy did not sample (prompt, template markup, tool results), with the
        images whose placeholders they hold (offsets relative to `ids`)."""
        self.images += [image.shifted(len(self.token_ids)) for image in images]
        self.token_ids += ids
        self.trainable += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.weight_versions += [PROMPT_VERSION] * len(ids)
        if self.routed_experts is not None:
            self.routed_experts += [None] * len(ids)
        if self.top_ids is not None and self.top_logprobs is not None:
            self.top_ids += [[] for _ in ids]
            self.top_logprobs += [[] for _ in ids]

    def append_generation(self, gen: Generation, max_tokens: int) -> None:
        """The engine's answer to exactly this segment's tokens as the prompt."""
        start = len(self.token_ids)
        self.token_ids += gen.token_ids
        self.trainable += [1] * len(gen.token_ids)
        self.logprobs += gen.logprobs
        self.weight_versions += gen.weight_versions
        if gen.routed_experts is not None:
            known = (self.routed_experts or [None] * start)[: gen.routing_start]
            rows = known + gen.routed_experts + [None]  # the last sampled token: not run yet
            if len(rows) != len(self.token_ids):
                rows = f"{len(gen.routed_experts)} routing rows from position {gen.routing_start}"
                tokens = f"a {start}-token prompt and {len(gen.token_ids)} sampled tokens"
                raise ValueError(f"{rows} for {tokens}")
            self.routed_experts = rows
        elif self.routed_experts is not None:
            self.routed_experts += [None] * len(gen.token_ids)
        if gen.top_ids is not None and self.top_ids is None:  # the first with top-k: none before it
            self.top_ids, self.top_logprobs = [[] for _ in range(start)], [[] for _ in range(start)]
        if self.top_ids is not None and self.top_logprobs is not None:
            self.top_ids += gen.top_ids or [[] for _ in gen.token_ids]
            self.top_logprobs += gen.top_logprobs or [[] for _ in gen.token_ids]
        self.turns.append(TurnSpan(start, len(self.token_ids), max_tokens, gen.finish_reason))

    @property
    def routing_known(self) -> int:
        """How many leading positions have routing rows: the next request's `routing_start`."""
        rows = self.routed_experts or []
        return next((i for i, row in enumerate(rows) if row is None), len(rows))

    @property
    def num_generated(self) -> int:
        return sum(self.trainable)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["images"] = [image.to_dict() for image in self.images]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Segment:
        turns = [TurnSpan(**t) for t in d.get("turns", [])]
        images = [ImageInput.from_dict(i) for i in d.get("images", [])]
        return cls(**{**d, "turns": turns, "images": images})


@dataclass
class Rollout:
    """One episode: its segments (several after context compaction) share reward and ids."""

    segments: list[Segment]
    reward: float
    rollout_id: str
    group_id: str
    score: float | None = None  # task score when it differs from the shaped reward
    info: dict[str, float] = field(default_factory=dict)  # numeric diagnostics
    timings: dict[str, float] = field(default_factory=dict)  # seconds, by stage

    def to_dict(self) -> dict[str, Any]:
        return {**vars(self), "segments": [s.to_dict() for s in self.segments]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rollout:
        return cls(**{**d, "segments": [Segment.from_dict(s) for s in d["segments"]]})
