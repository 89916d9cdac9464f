"""The weights leaving a model worker: full tensors under their Hugging Face names, the refit
into the engines (merged weights through the weight-transfer protocol, or LoRA adapters alone)
and the Hugging Face export. `ModelWorker` inherits these; like all of its methods each must
be called on every rank at once (every gather is a collective)."""

from __future__ import annotations

import copy
import math
import os
import shutil
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from molt_train.actor_config import DTYPES
from molt_train.checkpoint import write_hf_checkpoint
from molt_train.lora import ADAPTER_KEYS, adapted_layer, merge_adapters, write_adapter


def _hf_name(name: str) -> str:
    """State-dict name without the wrappers activation checkpointing / compile insert."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _unconverted_names(model: torch.nn.Module, state: dict[str, Tensor]) -> set[str]:
    """The (Hugging Face) names that transformers' revert_weight_conversion hands back as they
    are, from one call over shape-only copies of the state dict: called once per tensor it
    rebuilds the model's conversion mapping each time (0.14 s of a 0.16 s gather, 1.7B)."""
    from transformers.core_model_loading import revert_weight_conversion

    probe = {
        _hf_name(name): torch.empty(t.shape, dtype=t.dtype, device="meta")
        for name, t in state.items()
    }
    reverted = revert_weight_conversion(model, probe)
    return {name for name, t in reverted.items() if probe.get(name) is t}


# Full bytes per collective of the bucketed gather: per-tensor collectives cost more than
# their bytes (docs/benchmarks.md, "The sharded refit gather").
GATHER_BUCKET_BYTES = 512 << 20


def _row_sharded(tensor: Tensor) -> bool:
    """FSDP2's layout: a DTensor cut into row blocks over a 1-D mesh (torch.chunk's sizes)."""
    return (
        isinstance(tensor, DTensor)
        and tensor.dim() > 0
        and tensor.device_mesh.ndim == 1
        and tuple(tensor.placements) == (Shard(0),)
    )


def gather_full(items, device: torch.device, full_one) -> Iterator[tuple[str, Tensor]]:
    """(name, full tensor) for each (name, tensor, dtype to gather in or None) in order. Runs of
    row-sharded tensors of one dtype and mesh are gathered a bucket at a time, one all-gather
    each; anything else through `full_one(tensor, dtype)`. Every rank gets every tensor."""
    run: list[tuple[str, Tensor, torch.dtype]] = []
    size = 0

    def flush():
        nonlocal size
        if run:
            yield from _gather_bucket(list(run), device)
            run.clear()
            size = 0

    for name, tensor, dtype in items:
        if not _row_sharded(tensor):
            yield from flush()
            yield name, full_one(tensor, dtype)
            continue
        dtype = dtype or tensor.dtype
        nbytes = tensor.numel() * dtype.itemsize
        same = run and run[0][1].device_mesh == tensor.device_mesh and run[0][2] == dtype
        if run and (not same or size + nbytes > GATHER_BUCKET_BYTES):
            yield from flush()
        run.append((name, tensor, dtype))
        size += nbytes
    yield from flush()


def _gather_bucket(run: list[tuple[str, Tensor, torch.dtype]], device: torch.device):
    """One all-gather for a bucket of row-sharded tensors: each rank packs its row blocks (cast
    on the way) into one flat buffer, each padded to the block size, and every full tensor is
    cut out of the gathered buffers, rank by rank."""
    mesh, dtype = run[0][1].device_mesh, run[0][2]
    world = mesh.size()
    blocks = [(-(-t.shape[0] // world)) * math.prod(t.shape[1:]) for _, t, _ in run]
    flat = torch.empty(sum(blocks), dtype=dtype, device=device)
    offset = 0
    for (_, tensor, _), block in zip(run, blocks, strict=True):
        local = tensor.to_local().reshape(-1)  # at most one block: the last ranks' are short
        flat[offset : offset + local.numel()].copy_(local)  # casts; from the host if offloaded
        offset += block
    gathered = torch.empty(world * flat.numel(), dtype=dtype, device=device)
    dist.all_gather_into_tensor(gathered, flat, group=mesh.get_group())
    gathered = gathered.view(world, flat.numel())
    offset = 0
    for (name, tensor, _), block in zip(run, blocks, strict=True):
        rows = gathered[:, offset : offset + block].reshape(-1, *tensor.shape[1:])
        yield name, rows[: tensor.shape[0]]
        offset += block


def _drain(tensors) -> None:
    """Run a gather to its end (the ranks that have nothing to do with its tensors)."""
    for _ in tensors:
        pass


class WeightsOut:
    """Refit, export and full-state methods of `ModelWorker` (see there for the attributes)."""

    def named_full_tensors(
        self, dtype: torch.dtype | None = None, gather_in: torch.dtype | None = None
    ):
        """(name, full tensor) for every state-dict entry, unsharded, named and shaped as in the
        model's Hugging Face checkpoint (what vLLM loads), in `dtype` (None: as stored).
        Sharded tensors are cast to `gather_in` (default `dtype`) before their gather: in 16
        bits, half the bytes of the fp32 master weights cross the wire. Every rank must
        iterate it in step: each gather is a collective."""
        from transformers.core_model_loading import revert_weight_conversion

        adapter = getattr(self.model, "state_dict_adapter", None)
        state = self.model.state_dict()
        as_is = self._unconverted(state)
        early = gather_in or dtype

        def item(name: str, tensor: Tensor) -> tuple[str, Tensor, torch.dtype | None]:
            name = _hf_name(name)
            # An adapted layer's W, A and B are merged in fp32 first (molt_train.lora).
            merged = adapted_layer(name, self.lora_scales) is not None
            return name, tensor, None if merged else early

        items = (item(name, tensor) for name, tensor in state.items())
        gathered = gather_full(items, self.device, self._full)
        if self.lora_scales:  # the engines serve W + s B A under W's name (molt_train.lora)
            gathered = merge_adapters(gathered, self.lora_scales)
        for name, tensor in gathered:
            tensor = tensor.to(dtype or tensor.dtype)
            if adapter is not None:  # native AutoModel classes (MoE) map their own layout
                yield from adapter.convert_single_tensor_to_hf(name, tensor)
            elif name in as_is:
                yield name, tensor
            else:  # transformers classes undo their load-time conversions (fused MoE experts)
                yield from revert_weight_conversion(self.model, {name: tensor}).items()

    def _unconverted(self, state: dict[str, Tensor]) -> set[str]:
        """The names that reach the checkpoint as they are; probed once (they never change:
        3 ms of an 8 ms gather, 1.7B)."""
        if self.unconverted is None:
            adapter = getattr(self.model, "state_dict_adapter", None)
            self.unconverted = set() if adapter else _unconverted_names(self.model, state)
        return self.unconverted

    def named_adapter_tensors(self, dtype: torch.dtype):
        """(name, full tensor) of every LoRA A and B, under the model's module names."""
        for name, tensor in self.model.state_dict().items():
            if name.endswith(ADAPTER_KEYS):
                yield _hf_name(name), self._full(tensor).to(dtype)

    def check_adapter_names(self) -> None:
        """--actor.lora.refit adapter: vLLM finds an adapter by its layer's name in the Hugging
        Face checkpoint, so every adapted layer's weight must reach the checkpoint under its
        own name and shape (native AutoModel classes and transformers' load-time conversions
        may fuse or rename layers; merging does not mind, serving an adapter does)."""
        adapter = getattr(self.model, "state_dict_adapter", None)
        state = {_hf_name(name): t for name, t in self.model.state_dict().items()}
        as_is = self._unconverted(self.model.state_dict())
        renamed = []
        for layer in self.lora_scales:
            name = f"{layer}.weight"
            if adapter is None:
                kept = name in as_is
            else:  # a host tensor of the full shape through the class's own conversion
                probe = torch.empty(state[name].shape, dtype=state[name].dtype)
                out = list(adapter.convert_single_tensor_to_hf(name, probe))
                kept = len(out) == 1 and out[0][0] == name and out[0][1].shape == probe.shape
            if not kept:
                renamed.append(layer)
        if renamed:
            raise ValueError(
                f"--actor.lora.refit adapter: the adapted layer {renamed[0]} ({len(renamed)} "
                "such layers) is stored under another name or layout in the Hugging Face "
                "checkpoint, so vLLM could not apply its adapter; use --actor.lora.refit merged"
            )

    def _full(self, tensor: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """The full tensor of a shard, cast to `dtype` before the gather; an unsharded tensor
        as it is (its cast comes later, fused with the next copy where there is one)."""
        if isinstance(tensor, DTensor):
            # With offload the shards live on the host; gather on the device.
            tensor = tensor.to(self.device, dtype or tensor.dtype).full_tensor()
        return tensor.detach()

    def full_state(self) -> dict | None:
        """Unsharded weights (from `named_full_tensors`) and optimizer state on rank 0's host,
        None on the other ranks. For small models: tests and debugging."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        weights = {name: t.cpu() for name, t in self.named_full_tensors()}
        optim = None
        if self.optimizer is not None:
            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            optim = get_optimizer_state_dict(self.model, self.optimizer, options=full)
        return {"model": weights, "optim": optim, "steps": self.steps} if self.rank == 0 else None

    # ------------------------------------------------------------------ refit

    def init_refit(self, engine_urls: list[str], workers_per_engine: int, refit_cfg,
                   colocated: bool = False, adapters=None, adapter_dir: str = "",
                   network=None) -> None:  # fmt: skip
        """Rank 0 becomes rank 0 of the weight-transfer group with every engine worker (again,
        in a new group, after an engine restart; `colocated`: the engine is on rank 0's GPU).
        `adapters` (molt_rollout.adapters.AdapterServing): the adapter refit instead, which
        writes each version's adapter under `adapter_dir` and has the engines load it."""
        if self.rank != 0:
            return
        from molt_rollout.adapters import AdapterRefitter
        from molt_rollout.network import Network
        from molt_rollout.refit import Refitter

        network = network or Network()

        if adapters is not None:
            if self.refitter is None:
                # A directory per version, written at each refit; what an earlier process of
                # the run left (a resumed run) no engine serves any more.
                self.adapter_dir = adapter_dir
                shutil.rmtree(adapter_dir, ignore_errors=True)
                self.refitter = AdapterRefitter(engine_urls, refit_cfg, adapters, network.token)
            else:  # engines restarted: the window of adapters carries on
                self.refitter.set_engines(engine_urls)
            return
        if self.refitter is not None:
            self.refitter.release()
        self.refitter = Refitter(engine_urls, workers_per_engine, refit_cfg, self.on_gpu,
                                 colocated, network)  # fmt: skip
        self.refitter.init_transfer()

    def refit(self, version: int, pause_mode: str = "keep") -> dict[str, float]:
        """Every rank gathers; rank 0 streams the tensors to the engines as they come
        (`pause_mode`: see molt_rollout.refit.Refitter.refit), or, with the adapter refit,
        writes the adapters and has the engines load them (no pause: molt_rollout.adapters)."""
        dtype = DTYPES[self.cfg.dtype] if self.on_gpu else torch.float32
        if self.on_gpu:  # the step's queued kernels (the optimizer's) end before engines pause
            torch.cuda.current_stream().synchronize()
        if self.lora is not None and self.lora.refit == "adapter":
            return self._refit_adapter(version, dtype)
        # Unsharded tensors are cast to `dtype` as they are packed (buckets.py).
        tensors = self.named_full_tensors(gather_in=dtype)
        try:
            if self.rank == 0:
                return self.refitter.refit(tensors, version, pause_mode, dtype)
        finally:
            _drain(tensors)  # rank 0 too, when its refit failed: the others are gathering
        return {}

    def _refit_adapter(self, version: int, dtype: torch.dtype) -> dict[str, float]:
        start = time.perf_counter()
        path = f"{self.adapter_dir}/v{version}"  # rank 0's (init_refit)
        tensors = self.named_adapter_tensors(dtype)
        try:
            # Written once per version: again for the same one (an engine restarted), the
            # engines that serve it may be reading it.
            if self.rank == 0 and not os.path.exists(path):
                write_adapter(path, tensors, self.lora, self.model_path)
        finally:
            _drain(tensors)  # rank 0 too, when its write failed: the others are gathering
        if self.rank != 0:
            return {}
        written = time.perf_counter()
        times = self.refitter.refit(version, path)
        return {**times, "timing/refit_write": written - start,
                "timing/refit_total": time.perf_counter() - start}  # fmt: skip

    def set_engine_version(self, version: int) -> None:
        """The engines' weight version, without new weights (rank 0's Refitter)."""
        if self.rank == 0:
            self.refitter.set_version(version)

    # ------------------------------------------------------------------ export

    def export_hf(self, path: str) -> None:
        """safetensors shards + config + tokenizer, written by rank 0, in the dtype the source
        checkpoint declares (the model trains on fp32 master weights). With LoRA these are the
        merged weights, and `<path>_adapter` holds the adapters alone (PEFT format)."""
        from transformers import AutoConfig

        config = copy.deepcopy(self.model.config)
        declared = getattr(AutoConfig.from_pretrained(self.model_path), "dtype", None)
        if isinstance(declared, str):
            declared = getattr(torch, declared, None)
        config.dtype = declared if isinstance(declared, torch.dtype) else torch.float32
        tensors = self.named_full_tensors(config.dtype)
        if self.rank == 0:
            write_hf_checkpoint(path, tensors, config, self.model_path)
        _drain(tensors)
        if self.lora is not None:  # and the adapters alone, beside it (molt_train.lora)
            adapters = self.named_adapter_tensors(config.dtype)
            if self.rank == 0:
                write_adapter(f"{path}_adapter", adapters, self.lora, self.model_path)
            _drain(adapters)
        dist.barrier()
