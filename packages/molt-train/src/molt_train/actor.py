"""The policy actor's configuration and its driver-side handle, `ActorGroup`.

One role (policy, reference or critic) is one FSDP2-sharded model over `--actor.num_workers`
ranks: one Ray actor per device running `molt_train.worker.PolicyWorker` (the Ray actor is just
`ray.remote(PolicyWorker)`), one torch.distributed world (gloo on CPU, NCCL on GPU). The group
plans microbatches, sends each rank its share and returns results in the samples' order. The
trainer knows nothing about estimators: advantages and IS weights arrive per token on the
`Sample`s. Narrative: docs/training.md.
"""

import math
from dataclasses import dataclass, field

import torch

from molt_algos import POLICY_LOSSES, LossConfig
from molt_train.packing import Sample, plan_microbatches, unplan

ROLES = ("policy", "reference", "critic")
SCHEDULES = ("constant", "linear", "cosine")
OFFLOAD_MODES = ("none", "optimizer")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SFT_LOSS = "sft"  # train_step's loss name for supervised fine-tuning (NLL of trained tokens)
ROUTER_MARKER = "mlp.gate."  # Qwen3-MoE router weights: model.layers.N.mlp.gate.weight


@dataclass
class OptimConfig:
    lr: float = 1e-6  # AdamW learning rate (peak, after warmup)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW moment decays
    eps: float = 1e-8  # AdamW denominator epsilon
    warmup_steps: int = 0  # linear warmup from 0 to lr
    schedule: str = "constant"  # after warmup: constant | linear | cosine (down to min_lr)
    min_lr: float = 0.0  # the floor of linear/cosine decay
    total_steps: int | None = None  # decay horizon; required for linear/cosine
    max_grad_norm: float = 1.0  # clip the global gradient norm to this


@dataclass
class FSDPConfig:
    tp_size: int = 1  # tensor parallel ranks (GPU; AutoModel)
    cp_size: int = 1  # context parallel ranks: > 1 is rejected (not wired to packing yet)
    ep_size: int = 1  # expert parallel ranks for MoE models (GPU; AutoModel)
    offload: str = "none"  # none | optimizer (Adam states and sharded fp32 params on the host)
    reshard_after_forward: bool = True  # ZeRO-3; False keeps layers gathered (ZeRO-2-like)


@dataclass
class ActorConfig:
    model_path: str = ""  # HF dir or hub id; "" = the embedded tiny model
    num_workers: int = 2  # ranks (one per GPU; CPU processes on CPU)
    max_tokens_per_microbatch: int = 8192  # packing budget per microbatch
    gradient_checkpointing: bool = False  # activation checkpointing of decoder layers
    logprob_chunk_size: int = 1024  # tokens per block of molt_algos' chunked log-probs
    dtype: str = "bf16"  # GPU compute dtype (fp32 master weights); on CPU everything is fp32
    optim: OptimConfig = field(default_factory=OptimConfig)
    freeze_moe_router: bool = False  # do not train MoE router weights
    seed: int = 0  # base seed; each rank adds its rank


def validate_actor_config(
    actor: ActorConfig, fsdp: FSDPConfig, num_gpus_available: int | None
) -> None:
    """Raise ValueError naming the flags of a bad combination. `num_gpus_available`: the GPUs
    of the cluster (0 on CPU), or None while unknown (before Ray starts), which defers the
    checks that depend on the devices."""
    n, optim = actor.num_workers, actor.optim
    if n < 1:
        raise ValueError(f"--actor.num_workers must be >= 1, got {n}")
    for name in ("tp_size", "cp_size", "ep_size"):
        size = getattr(fsdp, name)
        if size < 1 or n % size:
            raise ValueError(
                f"--fsdp.{name} {size} must be >= 1 and divide --actor.num_workers {n}"
            )
    if n % (fsdp.tp_size * fsdp.cp_size):
        raise ValueError(f"--fsdp.tp_size * --fsdp.cp_size must divide --actor.num_workers {n}")
    if (n // fsdp.tp_size) % fsdp.ep_size:
        raise ValueError("--fsdp.ep_size must divide --actor.num_workers / --fsdp.tp_size")
    if fsdp.cp_size > 1:
        raise ValueError(
            "--fsdp.cp_size > 1 is not supported: microbatches pack several sequences into one "
            "row (block-diagonal attention), and AutoModel's context parallelism over SDPA "
            "(ring attention) needs one plain causal sequence per row. Use more "
            "--actor.num_workers or a smaller --actor.max_tokens_per_microbatch instead."
        )
    if fsdp.offload not in OFFLOAD_MODES:
        raise ValueError(f"--fsdp.offload {fsdp.offload!r}: choose one of {OFFLOAD_MODES}")
    if actor.dtype not in DTYPES:
        raise ValueError(f"--actor.dtype {actor.dtype!r}: choose one of {sorted(DTYPES)}")
    if actor.max_tokens_per_microbatch < 1 or actor.logprob_chunk_size < 1:
        raise ValueError("--actor.max_tokens_per_microbatch and --actor.logprob_chunk_size >= 1")
    if optim.schedule not in SCHEDULES:
        raise ValueError(f"--actor.optim.schedule {optim.schedule!r}: choose one of {SCHEDULES}")
    if not optim.lr > 0 or not 0 <= optim.min_lr <= optim.lr:
        raise ValueError("--actor.optim.lr must be > 0 and --actor.optim.min_lr in [0, lr]")
    if optim.warmup_steps < 0 or optim.max_grad_norm <= 0:
        raise ValueError("--actor.optim.warmup_steps >= 0 and --actor.optim.max_grad_norm > 0")
    if optim.schedule != "constant" and optim.total_steps is None:
        raise ValueError(f"--actor.optim.schedule {optim.schedule} needs --actor.optim.total_steps")
    if optim.total_steps is not None and optim.total_steps <= optim.warmup_steps:
        raise ValueError("--actor.optim.total_steps must exceed --actor.optim.warmup_steps")
    if num_gpus_available is None:
        return
    on_gpu = num_gpus_available > 0
    if not on_gpu and max(fsdp.tp_size, fsdp.ep_size) > 1:
        raise ValueError(
            "--fsdp.tp_size / --fsdp.ep_size > 1 need GPUs: AutoModel's tensor and expert "
            "parallelism run on CUDA devices only; on CPU the actor is FSDP2 data-parallel."
        )
    if on_gpu and n > num_gpus_available:
        raise ValueError(f"--actor.num_workers {n} exceeds the {num_gpus_available} GPUs available")


def lr_at(step: int, optim: OptimConfig) -> float:
    """The learning rate of optimizer step `step` (0-based): warmup (step + 1) / warmup_steps
    of lr, then constant, or linear/cosine decay reaching min_lr at total_steps and staying."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    progress = min(1.0, (step - optim.warmup_steps) / (optim.total_steps - optim.warmup_steps))
    shape = (
        1.0 - progress if optim.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    )
    return optim.min_lr + (optim.lr - optim.min_lr) * shape


def router_params(names: list[str]) -> list[str]:
    """The MoE router weights among parameter names (frozen by --actor.freeze_moe_router)."""
    return [name for name in names if ROUTER_MARKER in name]


class ActorGroup:
    """Driver-side handle of one role's workers (policy, reference or critic)."""

    def __init__(
        self,
        cfg: ActorConfig,
        fsdp: FSDPConfig,
        role: str = "policy",
        on_gpu: bool | None = None,
        routing_replay: bool = False,
    ) -> None:
        """`routing_replay`: forwards take each token's MoE routing from its Sample
        (--train.routing_replay, molt_train.routing)."""
        import ray

        if role not in ROLES:
            raise ValueError(f"role {role!r}: choose one of {ROLES}")
        gpus = int(ray.cluster_resources().get("GPU", 0))
        on_gpu = gpus > 0 if on_gpu is None else on_gpu
        validate_actor_config(cfg, fsdp, gpus if on_gpu else 0)
        self.cfg, self.fsdp, self.role, self.on_gpu = cfg, fsdp, role, on_gpu
        n = cfg.num_workers
        self.dp_size = n // fsdp.tp_size
        model_path = cfg.model_path
        if not model_path:  # built once here, not raced by the workers
            from molt_rollout.tiny_model import build_tiny_model

            model_path = str(build_tiny_model())
        self.model_path = model_path
        self._refit_ready = False
        self.placement = None

        options = [{"num_cpus": 0}] * n  # CPU: workers must not hold the cores engines need
        if on_gpu:
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            self.placement = placement_group([{"GPU": 1, "CPU": 1}] * n, strategy="PACK")
            ray.get(self.placement.ready(), timeout=600)
            options = [
                {
                    "num_gpus": 1,
                    "num_cpus": 1,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        self.placement, placement_group_bundle_index=i
                    ),
                }
                for i in range(n)
            ]
        from molt_train.worker import PolicyWorker  # here: worker.py imports these configs

        remote = ray.remote(PolicyWorker)
        self.workers = [
            remote.options(**options[rank]).remote(cfg, fsdp, role, rank, n, on_gpu, routing_replay)
            for rank in range(n)
        ]
        address, port = ray.get(self.workers[0].rendezvous_address.remote(), timeout=600)
        # Whether microbatches are padded rows instead of packed ones (PolicyWorker.setup).
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

    def _per_rank(self, plan: list[list[list[int]]], samples: list[Sample]):
        """The microbatches of each worker: TP ranks of one data-parallel group share theirs."""
        tp = self.fsdp.tp_size
        return [
            [[samples[i] for i in mb] for mb in plan[rank // tp]]
            for rank in range(len(self.workers))
        ]

    def _plan(self, samples: list[Sample]) -> list[list[list[int]]]:
        if not samples:
            raise ValueError("no samples")
        budget = self.cfg.max_tokens_per_microbatch
        return plan_microbatches(samples, budget, self.dp_size, self.padded)

    def forward_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Per-token log-probs of the temperature-scaled distribution, aligned with token_ids
        (0.0 at position 0 and off the loss mask), in the samples' order."""
        plan = self._plan(samples)
        per_rank = self._per_rank(plan, samples)
        results = self._all(lambda r, w: w.forward_logprobs.remote(per_rank[r]))
        return unplan(plan, results[:: self.fsdp.tp_size], len(samples))

    def forward_values(self, samples: list[Sample]) -> list[list[float]]:
        """Critic values V(token_ids[:t]) at each trained position t (0.0 elsewhere)."""
        if self.role != "critic":
            raise ValueError(f"forward_values needs the critic role, this group is {self.role!r}")
        return self.forward_logprobs(samples)

    def train_step(
        self,
        samples: list[Sample],
        loss_name: str,
        loss_cfg: LossConfig,
        aggregation: str = "token-mean",
        kl_loss_coef: float = 0.0,
        kl_estimator: str = "k3",
        entropy_coef: float = 0.0,
        value_clip: float | None = 0.2,
    ) -> dict[str, float]:
        """ONE optimizer step over all `samples`; metrics averaged over ranks (rank 0's copy).
        `loss_name` "sft" trains the negative log-likelihood of the trained tokens instead of a
        policy loss (no advantages needed; `loss_cfg` unused)."""
        if self.role == "reference":
            raise ValueError("the reference group does not train")
        if self.role == "policy" and loss_name not in (*POLICY_LOSSES, SFT_LOSS):
            choices = sorted([*POLICY_LOSSES, SFT_LOSS])
            raise ValueError(f"unknown policy loss {loss_name!r}; choose one of {choices}")
        if self.role == "critic":
            need = ["returns"]
        else:
            need = [] if loss_name == SFT_LOSS else ["advantages"]
            need += ["ref_logprobs"] if kl_loss_coef > 0 else []
        for name in need:
            if any(getattr(s, name) is None for s in samples):
                raise ValueError(f"train_step ({self.role}) needs Sample.{name} on every sample")
        plan = self._plan(samples)
        per_rank = self._per_rank(plan, samples)
        num_tokens = sum(s.num_trained for s in samples)
        num_sequences = sum(1 for s in samples if s.num_trained)
        kwargs = dict(
            loss_name=loss_name,
            loss_cfg=loss_cfg,
            aggregation=aggregation,
            kl_loss_coef=kl_loss_coef,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
            value_clip=value_clip,
        )
        results = self._all(
            lambda r, w: w.train_step.remote(per_rank[r], num_tokens, num_sequences, **kwargs)
        )
        return results[0]

    def full_state(self) -> dict:
        """Unsharded weights (HF names) and optimizer state, gathered to the driver: small models
        only (tests, debugging)."""
        return self._all(lambda r, w: w.full_state.remote())[0]

    def init_refit(self, engine_urls: list[str], workers_per_engine: int, refit_cfg) -> None:
        self._all(lambda r, w: w.init_refit.remote(engine_urls, workers_per_engine, refit_cfg))
        self._refit_ready = True

    def refit(self, version: int, pause_mode: str = "keep") -> dict[str, float]:
        """New weights into every engine as `version`; rank 0's timings (`timing/refit_*`)."""
        if not self._refit_ready:
            raise RuntimeError("refit before init_refit: no weight-transfer group yet")
        return self._all(lambda r, w: w.refit.remote(version, pause_mode))[0]

    def set_engine_version(self, version: int) -> None:
        self._all(lambda r, w: w.engine_call.remote("set_version", version))

    def pause_engines(self, mode: str = "keep") -> None:
        self._all(lambda r, w: w.engine_call.remote("pause", mode))

    def resume_engines(self) -> None:
        self._all(lambda r, w: w.engine_call.remote("resume"))

    def save(self, path: str) -> None:
        self._all(lambda r, w: w.save.remote(path))

    def load(self, path: str) -> None:
        self._all(lambda r, w: w.load.remote(path))

    def export_hf(self, path: str) -> None:
        self._all(lambda r, w: w.export_hf.remote(path))

    def shutdown(self) -> None:
        import ray

        try:
            self._all(lambda r, w: w.shutdown.remote())
        finally:
            for worker in self.workers:
                ray.kill(worker)
            if self.placement is not None:
                ray.util.remove_placement_group(self.placement)
