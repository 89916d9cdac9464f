"""One rank of a model group: its sharded model's forwards, optimizer steps and checkpoints."""

# docs/concepts/trainer.md, "The policy actor". `WeightsOut` hands out the full weights.

# A plain class: `ModelGroup` runs it as `ray.remote(ModelWorker)`,
# benchmarks/actor_gpu_smoke.py under torchrun.

from __future__ import annotations

import os
import socket
from datetime import timedelta

import nemo_automodel.components.training.utils as training
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from nemo_automodel.components.distributed.fsdp2 import fsdp2_sharding_enabled
from nemo_automodel.components.distributed.tp_replicas import synchronize_tp_replica_gradients
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import set_seed

from molt_algos.aggregation import AggregationWindow
from molt_algos.objective import AlgoConfig, Objective, policy_objective, value_objective
from molt_train.actor_config import DTYPES, ActorConfig, lr_at
from molt_train.attention import DOCUMENT_ATTENTION, document_attention, route_sdpa
from molt_train.checkpoint import rng_state, set_rng_state
from molt_train.context_parallel import CONTEXT_ATTENTION, ContextShard, context_attention
from molt_train.model_build import build_model, distributed_setup, is_multimodal
from molt_train.packing import PackedBatch, Sample, pack
from molt_train.routing_replay import agreement, install_replay_hooks, moe_routers, replaying
from molt_train.step_metrics import StepMetrics, peak_memory_gb
from molt_train.token_stats import TokenStats, packed_token_stats, packs_sequences
from molt_train.weights_out import WeightsOut


class ModelWorker:
    """One rank of a policy, reference or critic; every method runs on every rank at once."""

    def __init__(
        self, cfg: ActorConfig, fsdp, role, rank, world_size, on_gpu, routing=None
    ) -> None:
        self.cfg, self.fsdp, self.role = cfg, fsdp, role
        self.routing = routing  # None, "compare" or "replay": molt_train.routing_replay
        self.rank, self.world_size, self.on_gpu = rank, world_size, on_gpu
        self.compute = DTYPES[cfg.dtype] if on_gpu else torch.float32
        # The ranks FSDP averages gradients over (data x context parallel): each loss is
        # scaled by it. The ranks of one TP group see the same data.
        self.dp_cp_size = world_size // fsdp.tp_size
        self.lora = cfg.lora if role == "policy" and cfg.lora.rank else None  # the policy only
        self.device, self.padded, self.autocast = torch.device("cpu"), True, False
        self.shard: ContextShard | None = None  # this rank's context-parallel group, if any
        self.routers: list = []
        self.weights: WeightsOut | None = None
        self.optimizer = self.scheduler = None
        self.steps = 0

    def rendezvous_address(self) -> tuple[str, int]:
        """(this node's address, a free port) for the process group's TCP rendezvous."""
        from molt_rollout.network import node_address

        with socket.socket() as sock:
            sock.bind(("", 0))
            return node_address(), sock.getsockname()[1]

    def setup(self, path: str, master_addr: str | None = None, master_port: int | None = None):
        """Join the world, build the sharded model and optimizer; whether rows are padded."""
        # env:// without an address, as under torchrun.
        self.model_path = path
        if self.on_gpu:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        init = f"tcp://{master_addr}:{master_port}" if master_addr else "env://"
        backend, timeout = "nccl" if self.on_gpu else "gloo", timedelta(minutes=30)
        dist.init_process_group(backend, init, timeout, rank=self.rank, world_size=self.world_size)
        offload = self.on_gpu and self.fsdp.offload == "optimizer"
        self.distributed = distributed_setup(
            self.cfg, self.fsdp, self.world_size, self.compute, offload
        )
        # Every rank initialises new weights (the critic's value head) identically.
        torch.manual_seed(self.cfg.seed)
        self.model = build_model(
            path, self.cfg, self.role, self.lora, self.routing, self.device, self.distributed
        )
        self.weights = WeightsOut(self.model, self.device, self.rank, path, self.compute, self.lora)
        self.routers = moe_routers(self.model) if self.routing else []
        if self.routing and not self.routers:
            raise ValueError(
                f"--vllm.enable_return_routed_experts: {path} has no MoE router the trainer "
                "can compare or replay (AutoModel's native MoE classes on GPU; transformers' "
                "Qwen3-MoE, Qwen2-MoE and Mixtral routers on CPU)"
            )
        install_replay_hooks(self.routers)
        self._choose_layout()
        # AutoModel leaves a world of one unsharded, so FSDP's mixed-precision cast never
        # happens there: autocast to the compute dtype instead (fp32 master weights either way).
        unsharded = not fsdp2_sharding_enabled(self.distributed.mesh_context.device_mesh)
        self.autocast = self.on_gpu and unsharded and self.compute != torch.float32
        set_seed(self.cfg.seed + self.rank)  # Python's, numpy's, torch's and every CUDA device's
        if self.role == "reference":
            self.model.requires_grad_(False)
        else:
            self._create_optimizer()
        return self.padded

    def _choose_layout(self) -> None:
        """Padded rows, packed rows or context-parallel windows, and the attention they take."""
        # CPU: SDPA has no variable-length kernel, so a packed row would attend through a dense
        # [T, T] mask, quadratic in its length; padded rows take the causal kernel.
        packs = packs_sequences(self.model)
        self.padded = not self.on_gpu or not packs
        # Packed rows without transformers' dense mask (molt_train.attention): its fast path
        # needs 16 bits; not yet measured for the critic's class or under TP.
        documents = (
            self.compute != torch.float32 and self.role != "critic" and self.fsdp.tp_size == 1
        )
        if self.fsdp.cp_size > 1:  # windows of packed rows, on CPU too
            if not packs:
                raise ValueError(
                    f"--fsdp.cp_size > 1: {self.model_path}'s layers attend over the whole row, "
                    "not per packed document (a native AutoModel MoE class): use --fsdp.cp_size 1"
                )
            if is_multimodal(self.model_path):  # a window would hold part of an image
                raise ValueError(
                    f"--fsdp.cp_size > 1 with a vision-language model ({self.model_path}) is not "
                    "supported: use --fsdp.cp_size 1"
                )
            if not route_sdpa(self.model, CONTEXT_ATTENTION, context_attention):
                raise ValueError("--fsdp.cp_size > 1 needs a model attending through SDPA")
            mesh = self.distributed.mesh_context.device_mesh["cp"]
            self.shard = ContextShard(mesh.get_group(), mesh.get_local_rank(), mesh.size())
            self.padded = False
        elif not self.padded and documents:
            route_sdpa(self.model, DOCUMENT_ATTENTION, document_attention)

    def _create_optimizer(self) -> None:
        optim = self.cfg.optim
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        adam = dict(lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay)
        self.optimizer = torch.optim.AdamW(trainable, **adam)
        # Adam's state as its first step would create it, created now: a checkpoint taken
        # before the first step would otherwise have DCP create it by running a zero-gradient
        # step, which counts as step 1 and changes the bias correction of every later update.
        for param in trainable:
            moments = {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
            self.optimizer.state[param] = {"step": torch.zeros(()), **moments}
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_at(step, optim) / optim.lr
        )

    # ------------------------------------------------------------------ forward passes

    def _token_stats(self, batch: PackedBatch, with_entropy: bool) -> TokenStats:
        # TP shards the LM head; under EP AutoModel keeps it out of the mixed-precision policy
        # (fp32 next to bf16 hidden states): let the model project there.
        from_hidden = self.fsdp.tp_size == 1 and self.fsdp.ep_size == 1
        args = (self.cfg.logprob_chunk_size, with_entropy, self.role == "critic", from_hidden)
        with torch.autocast(self.device.type, self.compute, enabled=self.autocast):
            return packed_token_stats(self.model, batch, *args, self.shard)

    @torch.no_grad()
    def forward_logprobs(self, microbatches: list[list[Sample]]) -> list[list[np.ndarray]]:
        """Log-probs (critic: values) per microbatch and sample, 0.0 off the loss mask."""
        self.model.eval()
        kept = []
        for samples in microbatches:
            batch = pack(samples, self.device, self.padded)
            with replaying(self.routers, batch.routing, self.routing == "replay"):
                kept.append((samples, batch, self._token_stats(batch, False).logprobs))
        self._reshard()
        # Read back after the loop: a read per microbatch would leave the GPU idle while the
        # host packs the next one.
        return [batch.per_sample(rows) if samples else [] for samples, batch, rows in kept]

    def _reshard(self) -> None:
        """Every unit back to its shards (kept gathered, it would go stale at the next step)."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    # ------------------------------------------------------------------ one optimizer step

    def train_step(
        self,
        microbatches: list[list[Sample]],
        num_tokens: int,
        num_sequences: int,
        algo: AlgoConfig,
        sft: bool = False,
        value_clip: float | None = None,
        num_groups: int = 0,
        group_tokens: list[list[int]] | None = None,
        return_logprobs: bool = False,
    ):
        """One optimizer step's metrics; with `return_logprobs`, the pi_old log-probs used too."""
        # The counts are the whole window's (all ranks): each microbatch's loss is its share of
        # one global mean (molt_algos.aggregation).
        # group_tokens[i][k]: the window's tokens of the prompt group of microbatch i's sample
        # k, where an aggregation needs them.
        self.model.train()
        metrics, kept = StepMetrics(), []
        training.prepare_for_grad_accumulation([self.model])
        for i, samples in enumerate(microbatches):
            if i == len(microbatches) - 1:
                training.prepare_for_final_backward([self.model])
            batch = pack(samples, self.device, self.padded)
            rows = None  # an empty (padding) microbatch has one untrained row
            if group_tokens is not None:
                rows = torch.tensor(group_tokens[i] or [1], dtype=torch.float32)
            window = AggregationWindow(num_tokens, num_sequences, num_groups, rows)
            # Backward too: activation checkpointing reruns the forward there.
            with replaying(self.routers, batch.routing, self.routing == "replay"):
                objective = self._objective(batch, algo, window, sft, value_clip)
                objective.loss.backward()
            metrics.add(objective.totals, objective.per_token, batch.inputs.mask.sum())
            if return_logprobs:
                kept.append((samples, batch, objective.old_logprobs))
        metrics.add(agreement(self.routers) if self.routers else {}, {}, 0)  # this step's passes
        step = self._optimizer_step()
        # TP and CP ranks of one data-parallel group hold the same (whole-row) values.
        replicas = self.fsdp.tp_size * self.fsdp.cp_size
        step |= metrics.reduce(num_tokens, replicas, self.device)
        agreed, compared = step.pop("routing/agreed", 0), step.pop("routing/compared", 0)
        if compared:  # MoE with the engine's routing (molt_train.routing_replay)
            step["routing/agreement"] = agreed / compared
        step["train/tokens"] = float(num_tokens)
        if not return_logprobs:
            return step
        return step, [batch.per_sample(old) if samples else [] for samples, batch, old in kept]

    def _objective(
        self, batch: PackedBatch, algo: AlgoConfig, window, sft: bool, value_clip: float | None
    ) -> Objective:
        """One microbatch's forward, its tensors handed to molt_algos' objective."""
        if self.role == "critic":
            values = self._token_stats(batch, with_entropy=False).logprobs
            return value_objective(values, batch.inputs, algo, value_clip, window, self.dp_cp_size)
        logprobs, entropy, heads = self._token_stats(batch, with_entropy=True)
        inputs, dp_cp = batch.inputs, self.dp_cp_size
        return policy_objective(logprobs, entropy, heads, inputs, algo, window, dp_cp, sft)

    def _optimizer_step(self) -> dict[str, float]:
        meshes = self.distributed.mesh_context
        mesh, moe_mesh = meshes.device_mesh, meshes.moe_mesh
        synchronize_tp_replica_gradients([self.model], mesh)
        replication = training.get_expert_tp_replication_factor([self.model], mesh)
        grad_norm = training.scale_grads_and_clip_grad_norm(
            self.cfg.optim.max_grad_norm,
            [self.model],
            device_mesh=mesh,
            moe_mesh=moe_mesh,
            ep_axis_name="ep" if moe_mesh is not None else None,
            dp_group_size=self.dp_cp_size,
            expert_tp_replication_factor=replication,
            # PyTorch's foreach norm: AutoModel's Triton norm copies its tensor lists to the
            # GPU from pageable memory, a host wait each (docs/performance.md).
            use_torch_clip_grad_norm=True,
        )
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step is taken with
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.steps += 1
        memory = peak_memory_gb(self.on_gpu, self.device)
        return {"train/grad_norm": float(grad_norm), "train/lr": lr, "perf/peak_memory_gb": memory}

    # ------------------------------------------------------------------ weights out

    def full_state(self) -> dict | None:
        """Full weights and optimizer state on rank 0's host (small models: tests, debugging)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        weights = {name: t.cpu() for name, t in self.weights.named_full_tensors()}
        optim = None
        if self.optimizer is not None:
            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            optim = get_optimizer_state_dict(self.model, self.optimizer, options=full)
        return {"model": weights, "optim": optim, "steps": self.steps} if self.rank == 0 else None

    def call_weights(self, method: str, *args, **kwargs):
        """`WeightsOut.<method>` (init_refit, refit, export_hf, ...): Ray calls the worker only."""
        return getattr(self.weights, method)(*args, **kwargs)

    # ------------------------------------------------------------------ checkpoints, teardown

    def save(self, path: str) -> None:
        """Sharded DCP of model and optimizer (a trained model's: the reference is never saved);
        schedule, step count and RNG states in rank_<r>.pt."""
        os.makedirs(path, exist_ok=True)
        dcp.save(self._sharded_state(), checkpoint_id=path)
        scheduler = self.scheduler.state_dict()
        extra = {"steps": self.steps, "rng": rng_state(self.device), "scheduler": scheduler}
        torch.save(extra, os.path.join(path, f"rank_{self.rank:05d}.pt"))
        dist.barrier()

    def load(self, path: str) -> None:
        self._reshard()
        state = self._sharded_state()
        dcp.load(state, checkpoint_id=path)
        model, optim = state["model"], state["optim"]
        set_state_dict(self.model, self.optimizer, model_state_dict=model, optim_state_dict=optim)
        # Our own file: it holds numpy's RNG state, not just tensors.
        extra = torch.load(os.path.join(path, f"rank_{self.rank:05d}.pt"), weights_only=False)
        self.steps = extra["steps"]
        self.scheduler.load_state_dict(extra["scheduler"])
        set_rng_state(extra["rng"], self.device)

    def _sharded_state(self) -> dict:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def release_memory(self) -> None:
        """Cached blocks back to the GPU, for an engine waking on it (--vllm.enable_sleep_mode)."""
        if self.on_gpu:
            torch.cuda.empty_cache()

    def shutdown(self) -> None:
        if self.weights is not None:
            self.weights.close()
        if dist.is_initialized():
            dist.destroy_process_group()
