"""A rank's sharded weights as full Hugging Face tensors, into the engines and into exports."""

# docs/concepts/refit.md. Every method runs on every rank at once: gathers are collectives.

from __future__ import annotations

import copy
import math
import os
import shutil
import time
from collections.abc import Iterator
from functools import cached_property

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from molt_train.actor_config import LoRAConfig
from molt_train.checkpoint import write_hf_checkpoint
from molt_train.lora import (
    ADAPTER_KEYS,
    adapted_layer,
    adapter_scales,
    merge_adapters,
    write_adapter,
)

# Full bytes per collective of the bucketed gather: per-tensor collectives cost more than
# their bytes (docs/performance.md).
GATHER_BUCKET_BYTES = 512 << 20


def hf_name(name: str) -> str:
    """State-dict name without the wrappers activation checkpointing / compile insert."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


class WeightsOut:
    """`dtype`: the engines' (the compute dtype); `lora`: the policy's adapters."""

    def __init__(self, model, device, rank, model_path: str, dtype, lora: LoRAConfig | None = None):
        self.model, self.device, self.rank = model, device, rank
        # AutoModel's native classes convert their weights to HF names and layouts through it.
        self.state_dict_adapter = getattr(model, "state_dict_adapter", None)
        self.model_path, self.dtype, self.lora = model_path, dtype, lora
        self.refitter = None  # rank 0's: molt_rollout's Refitter or AdapterRefitter
        self.adapter_dir = ""  # rank 0, adapter refit: each version's adapter goes below it
        self.lora_scales: dict[str, float] = {}  # adapted layer -> alpha / rank
        if lora is not None:
            self.lora_scales = {hf_name(n): s for n, s in adapter_scales(model).items()}
            if lora.refit == "adapter":
                self.check_adapter_names()

    @cached_property
    def unconverted(self) -> set[str]:
        """The names transformers' revert_weight_conversion hands back as they are."""
        # One call over shape-only copies: per tensor it rebuilds its mapping each time.
        from transformers.core_model_loading import revert_weight_conversion

        if self.state_dict_adapter is not None:
            return set()
        probe = {
            hf_name(name): torch.empty(t.shape, dtype=t.dtype, device="meta")
            for name, t in self.model.state_dict().items()
        }
        reverted = revert_weight_conversion(self.model, probe)
        return {name for name, t in reverted.items() if probe.get(name) is t}

    def named_full_tensors(self, dtype=None, gather_in=None) -> Iterator[tuple[str, Tensor]]:
        """(name, full tensor) as in the model's Hugging Face checkpoint, in `dtype` (or stored)."""
        # Shards are cast to `gather_in` (default `dtype`) before their gather: in 16 bits, half
        # the bytes cross the wire.
        from transformers.core_model_loading import revert_weight_conversion

        early = gather_in or dtype
        items = (
            # An adapted layer's W, A and B are merged in fp32 first (molt_train.lora).
            (hf_name(name), t, None if adapted_layer(hf_name(name), self.lora_scales) else early)
            for name, t in self.model.state_dict().items()
        )
        gathered = gather_full(items, self.device)
        if self.lora_scales:  # the engines serve W + s B A under W's name
            gathered = merge_adapters(gathered, self.lora_scales)
        for name, tensor in gathered:
            tensor = tensor.to(dtype or tensor.dtype)
            if self.state_dict_adapter is not None:
                yield from self.state_dict_adapter.convert_single_tensor_to_hf(name, tensor)
            elif name in self.unconverted:
                yield name, tensor
            else:  # transformers classes undo their load-time conversions (fused MoE experts)
                yield from revert_weight_conversion(self.model, {name: tensor}).items()

    def named_adapter_tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
        """(name, full tensor) of every LoRA A and B, under the model's module names."""
        for name, tensor in self.model.state_dict().items():
            if name.endswith(ADAPTER_KEYS):
                yield hf_name(name), _full(tensor, self.device).to(dtype)

    def check_adapter_names(self) -> None:
        """Every adapted weight reaches the checkpoint under its own name and shape."""
        # --actor.lora.refit adapter: vLLM finds an adapter by its layer's checkpoint name.
        state = {hf_name(name): t for name, t in self.model.state_dict().items()}
        renamed = []
        for layer in self.lora_scales:
            name = f"{layer}.weight"
            kept = name in self.unconverted
            if self.state_dict_adapter is not None:  # a full-shape host tensor through it
                probe = torch.empty(state[name].shape, dtype=state[name].dtype)
                out = list(self.state_dict_adapter.convert_single_tensor_to_hf(name, probe))
                kept = len(out) == 1 and out[0][0] == name and out[0][1].shape == probe.shape
            if not kept:
                renamed.append(layer)
        if renamed:
            raise ValueError(
                f"--actor.lora.refit adapter: the adapted layer {renamed[0]} ({len(renamed)} "
                "such layers) is stored under another name or layout in the Hugging Face "
                "checkpoint, so vLLM could not apply its adapter; use --actor.lora.refit merged"
            )

    def init_refit(
        self, urls, per_engine, cfg, colocated=False, adapters=None, adapter_dir="", network=None
    ) -> None:
        """Rank 0's link to every engine worker (anew after a restart), or adapter refit."""
        # `adapters` (AdapterServing): each version's adapter is written under `adapter_dir`.
        if self.rank != 0:
            return
        from molt_rollout.network import Network
        from molt_rollout.refit.adapters import AdapterRefitter
        from molt_rollout.refit.control import Refitter

        network = network or Network()
        if adapters is not None and self.refitter is not None:
            self.refitter.set_engines(urls)  # restarted engines: the adapters carry on
        elif adapters is not None:
            # A directory per version, written at each refit; what an earlier process of the
            # run left (a resumed run) no engine serves any more.
            self.adapter_dir = adapter_dir
            shutil.rmtree(adapter_dir, ignore_errors=True)
            self.refitter = AdapterRefitter(urls, cfg, adapters, network.token)
        else:
            if self.refitter is not None:
                self.refitter.release()
            on_gpu = self.device.type == "cuda"
            self.refitter = Refitter(urls, per_engine, cfg, on_gpu, colocated, network)
            self.refitter.init_transfer()

    def refit(self, version: int, pause_mode: str = "keep") -> dict[str, float]:
        """Every rank gathers; rank 0 streams the tensors into the engines, or the adapters."""
        if self.device.type == "cuda":  # the step's queued kernels end before engines pause
            torch.cuda.current_stream().synchronize()
        if self.lora is not None and self.lora.refit == "adapter":
            return self._refit_adapter(version)
        # Unsharded tensors are cast to `dtype` as they are packed (molt_rollout.refit.buckets).
        tensors = self.named_full_tensors(gather_in=self.dtype)
        send = lambda: self.refitter.refit(tensors, version, pause_mode, self.dtype)
        return self._on_rank0(tensors, send) or {}

    def _refit_adapter(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        path = f"{self.adapter_dir}/v{version}"  # rank 0's (init_refit)
        tensors = self.named_adapter_tensors(self.dtype)

        def write() -> None:  # once per version: after a restart, engines may be reading it
            if not os.path.exists(path):
                write_adapter(path, tensors, self.lora, self.model_path)

        self._on_rank0(tensors, write)
        if self.rank != 0:
            return {}
        written = time.perf_counter()
        times = self.refitter.refit(version, path)
        total = time.perf_counter() - start
        return {**times, "timing/refit_write": written - start, "timing/refit_total": total}

    def set_engine_version(self, version: int) -> None:
        """The engines' weight version, without new weights (rank 0's Refitter)."""
        if self.rank == 0:
            self.refitter.set_version(version)

    def export_hf(self, path: str) -> None:
        """A Hugging Face checkpoint in the source's dtype; with LoRA, `<path>_adapter` too."""
        from transformers import AutoConfig

        config = copy.deepcopy(self.model.config)
        # transformers reads a declared dtype as a torch.dtype; none declared: fp32.
        declared = getattr(AutoConfig.from_pretrained(self.model_path), "dtype", None)
        config.dtype = declared if isinstance(declared, torch.dtype) else torch.float32
        tensors = self.named_full_tensors(config.dtype)
        self._on_rank0(tensors, lambda: write_hf_checkpoint(path, tensors, config, self.model_path))
        if self.lora is not None:
            adapters = self.named_adapter_tensors(config.dtype)
            write = lambda: write_adapter(f"{path}_adapter", adapters, self.lora, self.model_path)
            self._on_rank0(adapters, write)
        dist.barrier()

    def _on_rank0(self, tensors: Iterator, consume):
        """`consume()` on rank 0; every rank runs the gather to its end (rank 0 too: a failed
        `consume` must not leave the others gathering)."""
        try:
            return consume() if self.rank == 0 else None
        finally:
            for _ in tensors:
                pass

    def close(self) -> None:
        if self.refitter is not None:
            self.refitter.close()


def _full(tensor: Tensor, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """A shard's full tensor, cast to `dtype` before the gather; an unsharded one as it is."""
    # (Its cast comes later, fused with the next copy.)
    if isinstance(tensor, DTensor):  # with offload the shards live on the host
        tensor = tensor.to(device, dtype or tensor.dtype).full_tensor()
    return tensor.detach()


def _row_sharded(tensor: Tensor) -> bool:
    """FSDP2's layout: a DTensor cut into row blocks over a 1-D mesh (torch.chunk's sizes)."""
    return (
        isinstance(tensor, DTensor)
        and tensor.dim() > 0
        and tensor.device_mesh.ndim == 1
        and tuple(tensor.placements) == (Shard(0),)
    )


def gather_full(items, device: torch.device) -> Iterator[tuple[str, Tensor]]:
    """(name, full tensor) of each (name, tensor, gather dtype or None), in order, on every rank."""
    # Runs of row-sharded tensors of one dtype and mesh: a bucket per all-gather.
    run: list[tuple[str, Tensor, torch.dtype]] = []
    size = 0
    for name, tensor, dtype in items:
        if not _row_sharded(tensor):
            yield from _gather_bucket(run, device)
            run, size = [], 0
            yield name, _full(tensor, device, dtype)
            continue
        dtype = dtype or tensor.dtype
        nbytes = tensor.numel() * dtype.itemsize
        same = run and run[0][1].device_mesh == tensor.device_mesh and run[0][2] == dtype
        if run and (not same or size + nbytes > GATHER_BUCKET_BYTES):
            yield from _gather_bucket(run, device)
            run, size = [], 0
        run.append((name, tensor, dtype))
        size += nbytes
    yield from _gather_bucket(run, device)


def _gather_bucket(run: list[tuple[str, Tensor, torch.dtype]], device: torch.device):
    # One all-gather per bucket: each rank packs its row blocks (cast on the way, padded to the block size) into one flat
    # buffer; every full tensor is cut out of the gathered ones.
    if not run:
        return
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
