"""One rank of an actor group: builds the sharded model, runs forward passes and optimizer
steps, hands out full weights (refit, export: molt_train.weights_out) and writes sharded
checkpoints.

A plain class: `ModelGroup` runs it as `ray.remote(ModelWorker)`, and
benchmarks/actor_gpu_smoke.py runs it under torchrun without Ray. Every method after `setup`
must be called on all ranks at once: each runs FSDP collectives.
"""

from __future__ import annotations

import os
import random
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from molt_algos import (
    CENTERING_METRICS,
    POLICY_LOSSES,
    AggregationWindow,
    aggregate,
    importance_weights,
    kl_estimate,
    score_centering,
    value_loss,
)
from molt_algos.masked import masked_mean
from molt_train.actor_config import (
    DTYPES,
    ROUTER_MARKER,
    ActorConfig,
    FSDPConfig,
    lr_at,
    router_params,
)
from molt_train.attention import enable_document_attention
from molt_train.checkpoint import load_sharded, rng_state, save_sharded, set_rng_state
from molt_train.context_parallel import ContextShard, enable_context_attention
from molt_train.lora import adapter_scales, add_adapters, peft_config
from molt_train.packing import PackedBatch, Sample, empty_batch, pack
from molt_train.step_metrics import all_reduce_step_metrics, peak_memory_gb
from molt_train.token_stats import TokenStats, packed_token_stats, packs_sequences
from molt_train.weights_out import WeightsOut, _hf_name

if TYPE_CHECKING:
    from molt_train.config import AlgoConfig
from molt_train.routing_replay import install_replay_hooks, moe_routers, replaying


def _init_adam_state(optimizer: torch.optim.AdamW) -> None:
    """Adam's state as its first step would create it (step 0, zero moments), created now: a
    checkpoint taken before the first step would otherwise have DCP create it by running a
    zero-gradient step, which counts as step 1 and changes the bias correction of every later
    update."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.state[param] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(param),
                "exp_avg_sq": torch.zeros_like(param),
            }


def is_multimodal(path: str) -> bool:
    """Whether the checkpoint is a vision-language model (its config has a vision tower)."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None


def policy_class(multimodal: bool):
    """transformers' auto class of a policy: a VLM's conditional-generation class (Idefics3's
    is no AutoModelForCausalLM) takes the pixel values with the ids and has the LM head."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if multimodal else AutoModelForCausalLM


def _or_zeros(values: Tensor | None, like: Tensor) -> Tensor:
    """A field absent from a batch: only an empty (padding) microbatch, where nothing is
    trained, lacks the fields the driver checked for."""
    return torch.zeros_like(like, dtype=torch.float32) if values is None else values


class ModelWorker(WeightsOut):
    """One rank of a model group (policy, reference or critic). Call `setup` on every rank at once (it joins the process group),
    then any method on every rank at once: each runs FSDP collectives."""

    def __init__(
        self,
        cfg: ActorConfig,
        fsdp: FSDPConfig,
        role: str,
        rank: int,
        world_size: int,
        on_gpu: bool,
        routing_replay: bool = False,
    ) -> None:
        self.cfg, self.fsdp, self.role = cfg, fsdp, role
        self.routing_replay = routing_replay  # molt_train.routing_replay
        self.rank, self.world_size, self.on_gpu = rank, world_size, on_gpu
        # The ranks FSDP averages gradients over (data x context parallel): each loss is
        # scaled by it. The ranks of one TP group see the same data.
        self.dp_cp_size = world_size // fsdp.tp_size
        self.shard: ContextShard | None = None  # this rank's context-parallel group, if any
        self.refitter = None  # rank 0's: molt_rollout's Refitter or AdapterRefitter
        self.adapter_dir = ""  # rank 0, adapter refit: each version's adapter goes below it
        self.unconverted: set[str] | None = None  # names revert_weight_conversion leaves alone
        self.lora = cfg.lora if role == "policy" and cfg.lora.rank else None  # the policy only
        self.lora_scales: dict[str, float] = {}  # adapted layer -> alpha / rank
        self.optimizer = self.scheduler = None
        self.steps = 0

    def rendezvous_address(self) -> tuple[str, int]:
        """(this node's address, a free port) for the process group's TCP rendezvous."""
        from molt_rollout.network import node_address

        address = node_address()
        with socket.socket() as sock:
            sock.bind(("", 0))
            return address, sock.getsockname()[1]

    def setup(
        self, model_path: str, master_addr: str | None = None, master_port: int | None = None
    ) -> bool:
        """Join the world (env:// when no address is given, as under torchrun), build and shard
        the model, create the optimizer. Returns whether microbatches must be padded rows
        (`packs_sequences`), which the driver's microbatch plan needs."""
        from nemo_automodel.components.distributed.config import DistributedSetup, FSDP2Config
        from nemo_automodel.components.distributed.fsdp2 import fsdp2_sharding_enabled
        from nemo_automodel.components.distributed.mesh import ParallelismSizes
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        self.model_path = model_path
        if self.on_gpu:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        init = f"tcp://{master_addr}:{master_port}" if master_addr else "env://"
        dist.init_process_group(
            "nccl" if self.on_gpu else "gloo",
            init_method=init,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(minutes=30),
        )

        compute = DTYPES[self.cfg.dtype] if self.on_gpu else torch.float32
        strategy = FSDP2Config(
            # Master weights, gradients' reduction and Adam states in fp32; compute in `dtype`.
            mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32),
            # FSDP2's CPU offload keeps sharded params, gradients and Adam states on the host
            # and steps there. On CPU everything already lives on the host: a no-op.
            offload_policy=CPUOffloadPolicy()
            if self.on_gpu and self.fsdp.offload == "optimizer"
            else None,
            reshard_after_forward=self.fsdp.reshard_after_forward,
            activation_checkpointing=self.cfg.gradient_checkpointing,
        )
        sizes = ParallelismSizes(
            tp_size=self.fsdp.tp_size, cp_size=self.fsdp.cp_size, ep_size=self.fsdp.ep_size
        )
        self.setup_ = DistributedSetup.build(
            strategy,
            sizes,
            world_size=self.world_size,
            activation_checkpointing=self.cfg.gradient_checkpointing,
        )
        # Every rank initialises any new weights (the critic's value head) identically; the
        # per-rank seed below is for everything after.
        torch.manual_seed(self.cfg.seed)
        self.model = self._build_model(model_path)
        if self.lora is not None:
            self.lora_scales = {_hf_name(n): s for n, s in adapter_scales(self.model).items()}
            if self.lora.refit == "adapter":
                self.check_adapter_names()
        self.routers = moe_routers(self.model) if self.routing_replay else []
        if self.routing_replay and not self.routers:
            raise ValueError(
                f"--train.routing_replay: {model_path} has no MoE router the trainer can replay "
                "(AutoModel's native MoE classes on GPU; transformers' Qwen3-MoE, Qwen2-MoE and "
                "Mixtral routers on CPU)"
            )
        install_replay_hooks(self.routers)
        # CPU: SDPA has no variable-length kernel there, so a packed row attends through a
        # dense [T, T] block mask, quadratic in the row's total length (the quickstart's 128
        # x 23 tokens: a 0.080 s forward packed, 0.019 s padded, whose rows take its causal
        # kernel). docs/benchmarks.md, "The quickstart: step time and start-up".
        self.padded = not self.on_gpu or not packs_sequences(self.model)
        packed_gpu = self.on_gpu and not self.padded and compute != torch.float32
        if self.fsdp.cp_size > 1:  # windows of packed rows, on CPU too
            self.shard = self._context_shard()
            self.padded = False
        elif packed_gpu and self.role != "critic" and self.fsdp.tp_size == 1:
            # Packed rows without transformers' dense block mask (molt_train.attention), whose
            # fast path needs 16-bit compute; not yet measured for the critic's class or under
            # TP. CPU keeps SDPA's mask: the same results, and the document path's reference.
            enable_document_attention(self.model)
        # AutoModel leaves a world of one unsharded, so FSDP's mixed-precision cast never
        # happens there: autocast to the compute dtype instead (fp32 master weights either way).
        unsharded = not fsdp2_sharding_enabled(self.setup_.mesh_context.device_mesh)
        self.autocast = self.on_gpu and unsharded and compute != torch.float32
        self._seed(self.cfg.seed + self.rank)

        if self.role == "reference":
            self.model.requires_grad_(False)
            return self.padded
        optim = self.cfg.optim
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            trainable,
            lr=optim.lr,
            betas=optim.betas,
            eps=optim.eps,
            weight_decay=optim.weight_decay,
        )
        _init_adam_state(self.optimizer)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_at(step, optim) / optim.lr
        )
        return self.padded

    def _context_shard(self) -> ContextShard:
        """This rank's CP group (AutoModel's "cp" mesh axis), the model's attention routed
        through molt_train.context_parallel."""
        if not packs_sequences(self.model):
            raise ValueError(
                f"--fsdp.cp_size > 1: {self.model_path}'s layers attend over the whole row, "
                "not per packed document (a native AutoModel MoE class): use --fsdp.cp_size 1"
            )
        if is_multimodal(self.model_path):  # a window would hold part of an image's tokens
            raise ValueError(
                f"--fsdp.cp_size > 1 with a vision-language model ({self.model_path}) is not "
                "supported: use --fsdp.cp_size 1"
            )
        enable_context_attention(self.model)
        mesh = self.setup_.mesh_context.device_mesh["cp"]
        return ContextShard(mesh.get_group(), mesh.get_local_rank(), mesh.size())

    def _build_model(self, path: str) -> torch.nn.Module:
        """GPU: AutoModel's factory (native model classes, TP/EP), fp32 master weights with the
        mixed-precision policy above. CPU (AutoModel's factories call into CUDA) and the critic
        (the factory loads checkpoint weights by name and rejects the new value head): the
        transformers model, sharded by AutoModel's own FSDP2 parallelizer.

        The critic is the same backbone with a one-output token head: its value at token t
        reads the hidden state of token t - 1, like a log-prob."""
        critic = self.role == "critic"
        multimodal = is_multimodal(path)
        if self.on_gpu and not critic:
            from nemo_automodel import NeMoAutoModelForCausalLM, NeMoAutoModelForImageTextToText
            from nemo_automodel.components.utils.model_utils import FreezeConfig, ModuleSelector

            extra = {}
            if self.routing_replay:  # each native gate gets a RouterReplay handle
                extra["moe_overrides"] = {"enable_routing_replay": True}
            if self.cfg.freeze_moe_router:  # applied before sharding, like below
                router = ModuleSelector(glob="*" + ROUTER_MARKER.rstrip("."))
                extra["freeze_config"] = FreezeConfig(freeze_modules=[router])
            if self.lora is not None:  # adapters added and the base frozen before sharding
                extra["peft_config"] = peft_config(self.lora)
            # No Liger kernels: the trainer computes log-probs itself from the hidden states.
            factory = NeMoAutoModelForImageTextToText if multimodal else NeMoAutoModelForCausalLM
            return factory.from_pretrained(
                path,
                distributed_setup=self.setup_,
                dtype=torch.float32,
                use_liger_kernel=False,
                **extra,
            )
        from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
        from transformers import AutoModelForTokenClassification

        if critic:
            model = AutoModelForTokenClassification.from_pretrained(
                path, dtype=torch.float32, attn_implementation="sdpa", num_labels=1
            )
            # The head's dropout (0.1 by default): old and new values of the same weights must
            # agree for the clipped value loss.
            for module in model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
        else:
            model = policy_class(multimodal).from_pretrained(
                path, dtype=torch.float32, attn_implementation="sdpa"
            )
        if self.lora is not None:  # before sharding, as AutoModel's factory does on GPU
            add_adapters(model, self.lora)
        if self.cfg.freeze_moe_router:  # before sharding: FSDP reads requires_grad then
            for name, param in model.named_parameters():
                if router_params([name]):
                    param.requires_grad_(False)
        return parallelize_model(model.to(self.device), self.setup_.mesh_context)

    # ------------------------------------------------------------------ forward passes

    def _batch(self, samples: list[Sample]) -> PackedBatch:
        if not samples:
            return empty_batch(self.device, self.padded)
        return pack(samples, self.device, self.padded)

    def _token_stats(
        self, batch: PackedBatch, with_entropy: bool, head_ids: Tensor | None = None
    ) -> TokenStats:
        autocast = torch.autocast(self.device.type, DTYPES[self.cfg.dtype], enabled=self.autocast)
        with autocast:
            return packed_token_stats(
                self.model,
                batch,
                self.cfg.logprob_chunk_size,
                with_entropy,
                critic=self.role == "critic",
                # TP shards the LM head; under EP AutoModel keeps it out of the mixed-precision
                # policy (fp32 next to bf16 hidden states): let the model project there.
                from_hidden=self.fsdp.tp_size == 1 and self.fsdp.ep_size == 1,
                head_ids=head_ids,
                shard=self.shard,
            )

    @torch.no_grad()
    def forward_logprobs(self, microbatches: list[list[Sample]]) -> list[list[list[float]]]:
        """Log-probs (values for the critic) per microbatch per sample; 0.0 off the loss mask."""
        self.model.eval()
        # Read back after the loop, as train_step does: a read per microbatch would leave the
        # GPU idle while the host packs the next one.
        kept = []
        for samples in microbatches:
            batch = self._batch(samples)
            with replaying(self.routers, batch.routing):
                kept.append((batch, self._token_stats(batch, with_entropy=False).logprobs))
        self._reshard()
        return [batch.to_lists(rows) if samples else [] for samples, (batch, rows) in
                zip(microbatches, kept, strict=True)]  # fmt: skip

    def _reshard(self) -> None:
        """Units kept gathered after a no-grad forward would go stale at the next optimizer
        step or checkpoint load; put every unit back to its shards."""
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
        """One optimizer step over this rank's microbatches. `num_tokens` / `num_sequences` /
        `num_groups` count the whole step window (all ranks), and `group_tokens[i][k]` is the
        window's token count of the prompt group of microbatch i's sample k (for
        prompt-mean-token-mean; None otherwise), so every microbatch's loss is its share of
        one global mean (molt_algos.aggregation) and the update does not depend on the split.
        Returns the metrics; with `return_logprobs`, (metrics, the old-policy log-probs the
        loss used, per microbatch per sample, as `forward_logprobs` gives them)."""
        from nemo_automodel.components.distributed.tp_replicas import (
            synchronize_tp_replica_gradients,
        )
        from nemo_automodel.components.training.utils import (
            get_expert_tp_replication_factor,
            prepare_for_final_backward,
            prepare_for_grad_accumulation,
            scale_grads_and_clip_grad_norm,
        )

        def reducer(i: int):
            rows = None
            if group_tokens is not None:  # an empty (padding) microbatch has one untrained row
                rows = torch.tensor(group_tokens[i] or [1], dtype=torch.float32)
            window = AggregationWindow(num_tokens, num_sequences, num_groups, rows)

            def reduce(per_token: Tensor, mask: Tensor, loss: str) -> Tensor:
                mode = algo.aggregation_of(loss)
                return aggregate(per_token, mask, mode, dp_size=self.dp_cp_size, window=window)

            return reduce

        self.model.train()
        # Device scalars or floats, read once after the loop (a read per microbatch would make
        # the host wait for the GPU's queue in the middle of the step).
        totals: dict[str, Tensor | float] = {}  # summed over microbatches (and ranks, below)
        weighted: dict[str, Tensor | float] = {}  # sum of value x tokens, / num_tokens
        kept: list[tuple] = []  # (batch, old log-probs) per microbatch, read after the loop
        prepare_for_grad_accumulation([self.model])
        for i, samples in enumerate(microbatches):
            if i == len(microbatches) - 1:
                prepare_for_final_backward([self.model])
            batch = self._batch(samples)
            # Backward too: activation checkpointing reruns the forward there.
            with replaying(self.routers, batch.routing):
                reduce = reducer(i)
                if self.role == "critic":
                    loss, stats, per_token = self._value_loss(batch, reduce, value_clip)
                else:
                    loss, stats, per_token, old = self._policy_loss(batch, reduce, algo, sft)
                    if return_logprobs:
                        kept.append((batch, old.detach()) if samples else (None, None))
                loss.backward()
            tokens = batch.loss_mask.sum()
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
            for key, value in per_token.items():
                weighted[key] = weighted.get(key, 0.0) + value * tokens

        mesh, moe_mesh = self.setup_.mesh_context.device_mesh, self.setup_.mesh_context.moe_mesh
        synchronize_tp_replica_gradients([self.model], mesh)
        grad_norm = scale_grads_and_clip_grad_norm(
            self.cfg.optim.max_grad_norm,
            [self.model],
            device_mesh=mesh,
            moe_mesh=moe_mesh,
            ep_axis_name="ep" if moe_mesh is not None else None,
            dp_group_size=self.dp_cp_size,
            expert_tp_replication_factor=get_expert_tp_replication_factor([self.model], mesh),
            # Plain tensors (a world of one): PyTorch's foreach norm. AutoModel's Triton norm
            # copies its tensor lists to the GPU from pageable memory, each copy a host wait
            # between the backward and the optimizer's launches (docs/benchmarks.md, after-8).
            use_torch_clip_grad_norm=True,
        )
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step is taken with
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.steps += 1

        # TP and CP ranks of one data-parallel group hold the same (whole-row) values.
        replicas = self.fsdp.tp_size * self.fsdp.cp_size
        metrics = all_reduce_step_metrics(totals, weighted, num_tokens, replicas, self.device)
        metrics.update(
            {
                "train/grad_norm": float(grad_norm),
                "train/lr": lr,
                "train/tokens": float(num_tokens),
                "perf/peak_memory_gb": peak_memory_gb(self.on_gpu, self.device),
            }
        )
        if not return_logprobs:
            return metrics
        return metrics, [[] if batch is None else batch.to_lists(old) for batch, old in kept]

    def _policy_loss(
        self,
        batch: PackedBatch,
        reduce,
        algo: AlgoConfig,
        sft: bool,
    ) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor | float], Tensor]:
        """(loss to backpropagate, summed stats, per-token-mean stats, the old-policy log-probs
        it used) of one microbatch: the policy loss weighted by the IS weights, minus the
        entropy bonus, plus the KL penalty."""
        mask = batch.loss_mask
        centring = algo.score_centering and not sft and batch.head_ids is not None
        stats_ = self._token_stats(batch, True, batch.head_ids if centring else None)
        logprobs, entropy = stats_.logprobs, stats_.entropy
        old, weights = batch.fields["old_logprobs"], batch.fields["weights"]
        if old is None:  # on-policy: ratio 1
            old = logprobs.detach()
        rollout = batch.fields["rollout_logprobs"]
        if rollout is not None and not sft:
            # One optimizer step over the batch: this forward runs the weights the tokens are
            # trained from, so its detached log-probs are pi_old exactly and the IS weights
            # come from them, as the driver would compute them after a separate forward
            # (molt_train.experience.reuses_training_forward says when).
            weights = importance_weights(old, rollout, mask, algo.advantage)
        if sft:  # supervised: the negative log-likelihood of trained tokens
            per_token, metrics = torch.where(mask, -logprobs, torch.zeros_like(logprobs)), {}
        else:
            result = POLICY_LOSSES[algo.policy_loss](
                logprobs,
                old,
                _or_zeros(batch.fields["advantages"], logprobs),
                mask,
                algo.loss,
            )
            per_token, metrics = result.per_token, result.metrics
        if weights is not None:
            per_token = per_token * weights
        if centring:  # molt_algos.centering: same value, the score centred on the sampler's head
            per_token, centring_metrics = score_centering(
                per_token, logprobs, stats_.head_logprobs, batch.head_logprobs, mask
            )
            metrics = {**metrics, **centring_metrics}
        elif algo.score_centering and not sft:  # a padding microbatch: the same keys on every rank
            metrics = {**metrics, **dict.fromkeys(CENTERING_METRICS, 0.0)}
        policy_loss = reduce(per_token, mask, "policy")
        loss = policy_loss
        if algo.entropy_coef:
            # Only then: a zero coefficient would still send a (zero) gradient through the
            # entropy's part of every vocabulary slice in the log-prob backward.
            loss = loss - algo.entropy_coef * reduce(entropy, mask, "entropy")
        stats = dict(metrics)
        stats["loss/entropy"] = masked_mean(entropy.detach(), mask)
        kl_cfg = algo.kl
        if kl_cfg.loss_coef > 0:
            ref = batch.fields["ref_logprobs"]
            kl = kl_estimate(
                logprobs, logprobs.detach() if ref is None else ref, mask, kl_cfg.estimator
            )
            loss = loss + kl_cfg.loss_coef * reduce(kl, mask, "kl")
            stats["loss/ref_kl"] = masked_mean(kl.detach(), mask)  # the loss term's KL
        return loss, {"loss/policy": policy_loss.detach() / self.dp_cp_size}, stats, old

    def _value_loss(
        self, batch: PackedBatch, reduce, value_clip: float | None
    ) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor | float]]:
        """The critic's clipped value loss of one microbatch, with the same three outputs."""
        values = self._token_stats(batch, with_entropy=False).logprobs
        old = batch.fields["old_values"]
        returns = _or_zeros(batch.fields["returns"], values)
        old = values.detach() if old is None else old
        result = value_loss(values, old, returns, batch.loss_mask, value_clip)
        loss = reduce(result.per_token, batch.loss_mask, "value")
        return loss, {"loss/value": loss.detach() / self.dp_cp_size}, result.metrics

    # ------------------------------------------------------------------ checkpoints

    def save(self, path: str) -> None:
        """Sharded DCP of model (+ optimizer) into `path`; scheduler, step count and RNG states
        per rank beside it (molt_train.checkpoint)."""
        extra = {
            "steps": self.steps,
            "rng": rng_state(self.device if self.on_gpu else None),
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
        }
        save_sharded(path, self.model, self.optimizer, self.rank, extra)

    def load(self, path: str) -> None:
        self._reshard()
        extra = load_sharded(path, self.model, self.optimizer, self.rank)
        self.steps = extra["steps"]
        if self.scheduler is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
        set_rng_state(extra["rng"], self.device if self.on_gpu else None)

    def _seed(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # also seeds every CUDA device

    def release_memory(self) -> None:
        """Hand the blocks PyTorch's caching allocator keeps back to the GPU, so that an engine
        woken on it (--vllm.enable_sleep_mode) can map its memory again."""
        if self.on_gpu:
            torch.cuda.empty_cache()

    def shutdown(self) -> None:
        if self.refitter is not None:
            self.refitter.close()
        if dist.is_initialized():
            dist.destroy_process_group()
