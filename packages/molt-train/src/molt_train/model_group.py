"""`ModelGroup`: the driver's handle on one FSDP2-sharded model (policy, reference or critic):
one Ray actor per rank running `ModelWorker`, in one torch.distributed world. It plans the
microbatches, sends each rank its share and returns results in the samples' order."""

from __future__ import annotations

from typing import Literal

import numpy as np
import ray

from molt_algos import GROUP_AGGREGATIONS, AlgoConfig
from molt_rollout.engines.engine import gpu_bundles
from molt_rollout.engines.tiny_model import build_tiny_model
from molt_train.actor_config import ActorConfig, FSDPConfig
from molt_train.packing import Sample, plan_microbatches, unplan

Role = Literal["policy", "reference", "critic"]
SHUTDOWN_TIMEOUT_S = 10.0  # then the workers are killed (a healthy rank needs about 1 s)


def group_token_counts(samples: list[Sample], groups: list | None) -> tuple[int, list[int]]:
    """(prompt groups with a trained token, each sample's group's trained tokens)."""
    of = list(range(len(samples))) if groups is None else groups
    per_group: dict = {}
    for sample, group in zip(samples, of, strict=True):
        per_group[group] = per_group.get(group, 0) + sample.num_trained
    return sum(1 for n in per_group.values() if n), [per_group[g] for g in of]


class ModelGroup:
    """`routing` ("compare" or "replay"): forwards compare their MoE routing with the engine's
    in each Sample, or take that (molt_train.routing_replay). `colocation`: (placement group,
    GPU share) when sharing bundles with the engines (rank i in bundle i)."""

    def __init__(
        self,
        cfg: ActorConfig,
        fsdp: FSDPConfig,
        role: Role = "policy",
        on_gpu: bool | None = None,
        routing: str | None = None,
        colocation: tuple | None = None,
    ) -> None:
        self.on_gpu = ray.cluster_resources().get("GPU", 0) > 0 if on_gpu is None else on_gpu
        self.cfg, self.role, n = cfg, role, cfg.num_workers
        self.replicas = fsdp.tp_size * fsdp.cp_size  # ranks of one data-parallel group
        self.dp_size = n // self.replicas
        self.model_path = cfg.model_path or str(build_tiny_model())  # once, not raced by ranks
        # On GPU rank i is in bundle i: of one of its own, or of one shared with the engines.
        alone = self.on_gpu and colocation is None
        self.placement = gpu_bundles(n, cfg.ray_resources) if alone else None
        self.workers = [self._worker(rank, fsdp, routing, colocation) for rank in range(n)]
        address, port = ray.get(self.workers[0].rendezvous_address.remote(), timeout=600)
        # Whether microbatches are padded rows instead of packed ones (ModelWorker.setup).
        self.padded = self._all(lambda r, w: w.setup.remote(self.model_path, address, port))[0]

    def _worker(self, rank: int, fsdp: FSDPConfig, routing: str | None, colocation):
        """Rank `rank`'s Ray actor; on CPU with no core of its own (the engines need them)."""
        # Imported here: its modelling stack costs the driver seconds, paid after the engines'
        # start began.
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from molt_train.model_worker import ModelWorker

        cfg, n = self.cfg, self.cfg.num_workers
        options = {"num_cpus": 0, "resources": dict(cfg.ray_resources)}
        if self.on_gpu:
            bundles, share = colocation or (self.placement, 1.0)
            strategy = PlacementGroupSchedulingStrategy(bundles, placement_group_bundle_index=rank)
            options |= {"num_gpus": share, "num_cpus": 0 if colocation else 1}
            options["scheduling_strategy"] = strategy
        remote = ray.remote(ModelWorker).options(**options)
        return remote.remote(cfg, fsdp, self.role, rank, n, self.on_gpu, routing)

    def _all(self, call) -> list:
        """`call(rank, worker)` on every worker, failing fast (the rest would wait in a collective)."""
        refs = [call(rank, worker) for rank, worker in enumerate(self.workers)]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)
        return ray.get(refs)

    def _per_rank(self, plan: list[list[list[int]]], values: list) -> list:
        """Each worker's microbatches of `values`; a data-parallel group's TP and CP ranks share
        theirs (AutoModel's mesh orders ranks dp, cp, tp)."""
        return [
            [[values[i] for i in mb] for mb in plan[r // self.replicas]]
            for r in range(len(self.workers))
        ]

    def _plan(self, samples: list[Sample]) -> list[list[list[int]]]:
        return plan_microbatches(
            samples, self.cfg.max_tokens_per_microbatch, self.dp_size, self.padded
        )

    def forward_logprobs(self, samples: list[Sample]) -> list[np.ndarray]:
        """Per-token log-probs at the temperature (critic: values) by token_ids; 0.0 off the mask."""
        plan = self._plan(samples)
        per_rank = self._per_rank(plan, samples)
        results = self._all(lambda r, w: w.forward_logprobs.remote(per_rank[r]))
        return unplan(plan, results[:: self.replicas], len(samples))

    def train_step(
        self,
        samples: list[Sample],
        algo: AlgoConfig,
        sft: bool = False,
        value_clip: float | None = None,
        groups: list[str] | None = None,
        return_logprobs: bool = False,
    ):
        """ONE optimizer step over all `samples` (`sft`: negative log-likelihood; a critic: the
        value loss); rank 0's metrics, with `return_logprobs` also the old log-probs it used."""
        plan = self._plan(samples)
        per_rank = self._per_rank(plan, samples)
        num_tokens = sum(s.num_trained for s in samples)
        num_sequences = sum(1 for s in samples if s.num_trained)
        num_groups, group_tokens = 0, [None] * len(self.workers)
        if algo.aggregations() & GROUP_AGGREGATIONS:
            num_groups, tokens = group_token_counts(samples, groups)
            group_tokens = self._per_rank(plan, tokens)
        args = (num_tokens, num_sequences, algo, sft, value_clip, num_groups)
        results = self._all(
            lambda r, w: w.train_step.remote(per_rank[r], *args, group_tokens[r], return_logprobs)
        )
        if not return_logprobs:
            return results[0]
        logprobs = unplan(plan, [rows for _, rows in results[:: self.replicas]], len(samples))
        return results[0][0], logprobs

    def full_state(self) -> dict:
        """Unsharded weights (HF names) and optimizer state on the driver: small models only."""
        return self._all(lambda r, w: w.full_state.remote())[0]

    def init_refit(self, *args, **kwargs) -> None:
        self._all(lambda r, w: w.call_weights.remote("init_refit", *args, **kwargs))

    def refit(self, version: int, pause_mode: str = "keep") -> dict[str, float]:
        """New weights into every engine as `version`; rank 0's timings (`timing/refit_*`)."""
        return self._all(lambda r, w: w.call_weights.remote("refit", version, pause_mode))[0]

    def set_engine_version(self, version: int) -> None:
        self._all(lambda r, w: w.call_weights.remote("set_engine_version", version))

    def save(self, path: str) -> None:
        self._all(lambda r, w: w.save.remote(path))

    def load(self, path: str) -> None:
        self._all(lambda r, w: w.load.remote(path))

    def export_hf(self, path: str) -> None:
        self._all(lambda r, w: w.call_weights.remote("export_hf", path))

    def release_memory(self) -> None:
        self._all(lambda r, w: w.release_memory.remote())

    def shutdown(self) -> None:
        try:  # bounded: a rank stuck in a collective with a dead engine never answers
            refs = [w.shutdown.remote() for w in self.workers]
            ray.wait(refs, num_returns=len(refs), timeout=SHUTDOWN_TIMEOUT_S)
        finally:
            for worker in self.workers:
                ray.kill(worker)
            if self.placement is not None:
                ray.util.remove_placement_group(self.placement)
