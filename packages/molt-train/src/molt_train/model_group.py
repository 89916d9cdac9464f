"""`ModelGroup`: the driver-side handle of one model's ranks (policy, reference or critic).

One role is one FSDP2-sharded model over `--actor.num_workers` ranks: one Ray actor per device
running `molt_train.model_worker.ModelWorker` (the Ray actor is just `ray.remote(ModelWorker)`),
one torch.distributed world (gloo on CPU, NCCL on GPU). The group
plans microbatches, sends each rank its share and returns results in the samples' order. The
trainer knows nothing about estimators: advantages and IS weights arrive per token on the
`Sample`s. Narrative: docs/training.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from molt_algos import GROUP_AGGREGATIONS
from molt_rollout.engine import gpu_bundles
from molt_train.actor_config import ActorConfig, FSDPConfig
from molt_train.packing import Sample, plan_microbatches, unplan

if TYPE_CHECKING:
    from molt_train.config import AlgoConfig

Role = Literal["policy", "reference", "critic"]
SHUTDOWN_TIMEOUT_S = 10.0  # then the workers are killed (a healthy rank needs about 1 s)


def group_token_counts(samples: list[Sample], groups: list | None) -> tuple[int, list[int]]:
    """(prompt groups with a trained token, each sample's group's trained tokens) over the
    window `samples`; `groups` None: every sample is a prompt of its own."""
    of = list(range(len(samples))) if groups is None else groups
    per_group: dict = {}
    for sample, group in zip(samples, of, strict=True):
        per_group[group] = per_group.get(group, 0) + sample.num_trained
    return sum(1 for n in per_group.values() if n), [per_group[g] for g in of]


class ModelGroup:
    """Driver-side handle of one role's workers (policy, reference or critic)."""

    def __init__(
        self,
        cfg: ActorConfig,
        fsdp: FSDPConfig,
        role: Role = "policy",
        on_gpu: bool | None = None,
        routing_replay: bool = False,
        colocation: tuple | None = None,
    ) -> None:
        """`routing_replay`: forwards take each token's MoE routing from its Sample
        (--train.routing_replay, molt_train.routing_replay). `colocation`: (placement group,
        GPU share) when the role shares bundles with the engines and other roles
        (--train.colocate; rank i in bundle i). `cfg` was validated at start-up."""
        import ray

        on_gpu = ray.cluster_resources().get("GPU", 0) > 0 if on_gpu is None else on_gpu
        self.cfg, self.fsdp, self.role, self.on_gpu = cfg, fsdp, role, on_gpu
        n = cfg.num_workers
        # TP and CP ranks of one data-parallel group get the same microbatches.
        self.replicas = fsdp.tp_size * fsdp.cp_size
        self.dp_size = n // self.replicas
        model_path = cfg.model_path
        if not model_path:  # built once here, not raced by the workers
            from molt_rollout.tiny_model import build_tiny_model

            model_path = str(build_tiny_model())
        self.model_path = model_path
        self.placement = None

        # CPU: workers must not hold the cores engines need.
        options = [{"num_cpus": 0, "resources": dict(cfg.ray_resources)}] * n
        if on_gpu:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            if colocation is None:  # rank i holds bundle i's GPU alone
                self.placement = gpu_bundles(n, cfg.ray_resources)
                bundles, share = self.placement, 1.0
            else:
                bundles, share = colocation
            options = [
                {
                    "num_gpus": share,
                    "resources": dict(cfg.ray_resources),
                    "num_cpus": 0 if colocation else 1,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        bundles, placement_group_bundle_index=i
                    ),
                }
                for i in range(n)
            ]
        # Imported here: its modelling stack (nemo_automodel, torch.distributed.tensor) costs
        # the driver 2.5 s, which it now pays after the engines' start began.
        from molt_train.model_worker import ModelWorker

        remote = ray.remote(ModelWorker)
        self.workers = [
            remote.options(**options[rank]).remote(cfg, fsdp, role, rank, n, on_gpu, routing_replay)
            for rank in range(n)
        ]
        address, port = ray.get(self.workers[0].rendezvous_address.remote(), timeout=600)
        # Whether microbatches are padded rows instead of packed ones (ModelWorker.setup).
        self.padded = self._all(lambda r, w: w.setup.remote(model_path, address, port))[0]

    def _all(self, call) -> list:
        """Run `call(rank, worker)` on every worker; fail fast when one raises (the others would
        wait for it in a collective until their timeout)."""
        import ray

        refs = [call(rank, worker) for rank, worker in enumerate(self.workers)]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)
        return ray.get(refs)

    def _per_rank(self, plan: list[list[list[int]]], samples: list):
        """The microbatches of each worker (or any per-sample values laid out like them): the
        TP and CP ranks of one data-parallel group share theirs (AutoModel's mesh orders
        ranks dp, cp, tp)."""
        return [
            [[samples[i] for i in mb] for mb in plan[rank // self.replicas]]
            for rank in range(len(self.workers))
        ]

    def _plan(self, samples: list[Sample]) -> list[list[list[int]]]:
        budget = self.cfg.max_tokens_per_microbatch
        return plan_microbatches(samples, budget, self.dp_size, self.padded)

    def forward_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Per-token log-probs of the temperature-scaled distribution, aligned with token_ids
        (0.0 at position 0 and off the loss mask), in the samples' order."""
        plan = self._plan(samples)
        per_rank = self._per_rank(plan, samples)
        results = self._all(lambda r, w: w.forward_logprobs.remote(per_rank[r]))
        return unplan(plan, results[:: self.replicas], len(samples))

    def forward_values(self, samples: list[Sample]) -> list[list[float]]:
        """Critic values V(token_ids[:t]) at each trained position t (0.0 elsewhere)."""
        return self.forward_logprobs(samples)

    def train_step(
        self,
        samples: list[Sample],
        algo: AlgoConfig,
        sft: bool = False,
        value_clip: float | None = None,
        groups: list[str] | None = None,
        return_logprobs: bool = False,
    ):
        """ONE optimizer step over all `samples`; metrics averaged over ranks (rank 0's copy).
        With `return_logprobs`: (metrics, the old-policy log-probs the loss used per sample,
        in the samples' order, as `forward_logprobs` gives them).
        The policy minimises `algo`'s loss (`sft`: the negative log-likelihood of the trained
        tokens instead, no advantages needed); a critic the value loss clipped at `value_clip`,
        aggregated by `algo.aggregation_of("value")`. Samples carry what the loss needs (the loop's experience);
        `groups` names each sample's prompt group (prompt-mean-token-mean; None: every sample
        is a prompt of its own)."""
        plan = self._plan(samples)
        per_rank = self._per_rank(plan, samples)
        num_tokens = sum(s.num_trained for s in samples)
        num_sequences = sum(1 for s in samples if s.num_trained)
        num_groups, group_tokens = 0, None
        if algo.aggregations() & GROUP_AGGREGATIONS:
            num_groups, tokens = group_token_counts(samples, groups)
            group_tokens = self._per_rank(plan, tokens)
        results = self._all(
            lambda r, w: w.train_step.remote(
                per_rank[r], num_tokens, num_sequences, algo, sft, value_clip, num_groups,
                None if group_tokens is None else group_tokens[r], return_logprobs,
            )
        )  # fmt: skip
        if not return_logprobs:
            return results[0]
        logprobs = unplan(plan, [rows for _, rows in results[:: self.replicas]], len(samples))
        return results[0][0], logprobs

    def full_state(self) -> dict:
        """Unsharded weights (HF names) and optimizer state, gathered to the driver: small models
        only (tests, debugging)."""
        return self._all(lambda r, w: w.full_state.remote())[0]

    def init_refit(self, engine_urls: list[str], workers_per_engine: int, refit_cfg,
                   colocated: bool = False, adapters=None, adapter_dir: str = "",
                   network=None) -> None:  # fmt: skip
        """Rank 0's link to the engines (molt_train.weights_out); `adapters`: the adapter refit,
        each version's adapter written under `adapter_dir`; `network`: the run's addresses and
        token (molt_rollout.network; None: loopback)."""
        self._all(lambda r, w: w.init_refit.remote(engine_urls, workers_per_engine, refit_cfg,
                                                   colocated, adapters, adapter_dir,
                                                   network))  # fmt: skip

    def refit(self, version: int, pause_mode: str = "keep") -> dict[str, float]:
        """New weights into every engine as `version` (after `init_refit`); rank 0's timings
        (`timing/refit_*`)."""
        return self._all(lambda r, w: w.refit.remote(version, pause_mode))[0]

    def set_engine_version(self, version: int) -> None:
        """Tell the engines which weight version they hold (a fresh run: the initial one)."""
        self._all(lambda r, w: w.set_engine_version.remote(version))

    def save(self, path: str) -> None:
        self._all(lambda r, w: w.save.remote(path))

    def load(self, path: str) -> None:
        self._all(lambda r, w: w.load.remote(path))

    def export_hf(self, path: str) -> None:
        self._all(lambda r, w: w.export_hf.remote(path))

    def release_memory(self) -> None:
        """Every worker's cached GPU blocks back to the GPU (ModelWorker.release_memory)."""
        self._all(lambda r, w: w.release_memory.remote())

    def shutdown(self) -> None:
        import ray

        try:  # bounded: a rank stuck in a collective with a dead engine never answers
            ray.wait([w.shutdown.remote() for w in self.workers],
                     num_returns=len(self.workers), timeout=SHUTDOWN_TIMEOUT_S)  # fmt: skip
        finally:
            for worker in self.workers:
                ray.kill(worker)
            if self.placement is not None:
                ray.util.remove_placement_group(self.placement)
