"""Molt's CUDA-IPC weight-transfer backend, for an engine on the trainer's own GPU (colocated).

vLLM's own `ipc` backend shares every tensor of every refit by a fresh CUDA-IPC handle, pickled
over HTTP, and the engine maps and unmaps the trainer's memory for each one. Here the trainer
copies each bucket into one staging buffer that it shares once; every `update_weights` call
names the buffer (the same handle each time) and the bucket's layout (buckets.py). The engine
maps the buffer on first sight, keeps it mapped, copies the bucket out and loads it through
vLLM's layerwise reload, like every other backend. The handle travels as plain JSON fields:
no pickle, so the engine needs no VLLM_ALLOW_INSECURE_SERIALIZATION.

Engine side: `BufferIpcEngine`, registered by Molt's vLLM plugin (vllm_plugin.py), created by
`--weight-transfer-config '{"backend": "molt_ipc"}'`. Trainer side: `molt_rollout.refit.IpcTransport`.
"""

import base64
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

from molt_rollout.buckets import BucketMeta, unpack

BACKEND = "molt_ipc"
_BYTES = ("handle", "ref_counter_handle", "event_handle")  # base64 in JSON
_FIELDS = ("device", "handle", "size_bytes", "offset_bytes", "ref_counter_handle",
           "ref_counter_offset", "event_handle", "event_sync_required")  # fmt: skip


def gpu_uuid(device: int | torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def share(buffer: torch.Tensor) -> dict:
    """A CUDA uint8 buffer's IPC handle as JSON fields. Call once per buffer: each call makes
    a reference the receiver must release."""
    values = buffer.untyped_storage()._share_cuda_()
    fields = dict(zip(_FIELDS, values, strict=True))
    for key in _BYTES:  # the event handle is None where no event is needed
        fields[key] = None if fields[key] is None else base64.b64encode(fields[key]).decode()
    return {**fields, "numel": buffer.numel(), "gpu_uuid": gpu_uuid(buffer.device)}


def open_shared(fields: dict, device_index: int) -> torch.Tensor:
    """The buffer `share` described, mapped into this process on its own device index (the
    same GPU may have another index here: CUDA_VISIBLE_DEVICES)."""
    if fields["gpu_uuid"] != gpu_uuid(device_index):
        raise ValueError(
            f"{BACKEND}: the trainer's buffer is on GPU {fields['gpu_uuid']}, this engine on "
            f"{gpu_uuid(device_index)}: CUDA IPC needs both on one GPU (--train.colocate)"
        )
    raw = {k: base64.b64decode(v) if k in _BYTES and v is not None else v
           for k, v in fields.items()}  # fmt: skip
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size([raw["numel"]]), (1,), 0, torch.UntypedStorage, torch.uint8,
        device_index, raw["handle"], raw["size_bytes"], raw["offset_bytes"], False,
        raw["ref_counter_handle"], raw["ref_counter_offset"], raw["event_handle"],
        raw["event_sync_required"],
    )  # fmt: skip


@dataclass
class BufferUpdateInfo(WeightTransferUpdateInfo, BucketMeta):
    buffer: dict = None  # `share` of the trainer's staging buffer (a default: after BucketMeta's)


class BufferIpcEngine(IPCWeightTransferEngine):
    """vLLM's IPC engine (layerwise reload in start/finish, its per-tensor handles still
    accepted: benchmarks/refit_ipc.py compares the two on one engine) plus updates that name
    the trainer's staging buffer, kept mapped between refits."""

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.handle: str | None = None
        self.staging: torch.Tensor | None = None
        self.reloading: bool | None = None  # this update's load path, set by its first bucket

    def start_weight_update(self) -> None:
        self.reloading = None  # decided by the first bucket: see receive_weights

    def finish_weight_update(self) -> None:
        if self.reloading:
            super().finish_weight_update()
        self.reloading = None

    def parse_update_info(self, update_dict: dict):
        if "buffer" not in update_dict:
            return super().parse_update_info(update_dict)
        try:
            return BufferUpdateInfo(**update_dict)
        except TypeError as error:
            raise ValueError(f"Invalid update_info for {BACKEND}: {error}") from error

    def receive_weights(self, update_info) -> None:
        ours = isinstance(update_info, BufferUpdateInfo)
        if self.reloading is None:
            # vLLM's layerwise reload rebuilds each layer and reruns its post-load processing;
            # a model with none to rerun takes the weights in place, as a copy into each
            # parameter (0.11 of a 0.16 s refit of 4 GB went to the rebuild, on an H200).
            self.reloading = not (ours and loads_in_place(self.model, self.vllm_config))
            if self.reloading:
                super().start_weight_update()
        if not ours:  # vLLM's own per-tensor handles
            return super().receive_weights(update_info)
        fields = update_info.buffer
        if fields["handle"] != self.handle:  # the first bucket, or the trainer grew its buffer
            self.staging = open_shared(fields, self.device.index)
            self.handle = fields["handle"]
        bucket = self.staging[: update_info.numbytes()]
        if self.reloading:  # it holds a layer's tensors until the layer is complete, maybe
            bucket = bucket.clone()  # after the trainer has refilled the buffer
        self.model.load_weights(unpack(bucket, update_info))
        # The base class's update_weights then synchronizes: the trainer refills after the reply.

    def shutdown(self) -> None:
        self.handle = self.staging = None


def loads_in_place(model: torch.nn.Module, vllm_config) -> bool:
    """Whether new weights may be copied straight into the model's parameters: nothing is
    computed from them after loading (no quantization, no fp8 KV-cache scales, no fused-MoE
    weight layouts, no MLA weight absorption). Otherwise vLLM's layerwise reload."""
    if vllm_config.model_config.quantization or vllm_config.cache_config.cache_dtype != "auto":
        return False
    # By class name along each module's bases: where the classes live differs between versions.
    processed = {"FusedMoE", "MLAAttention"}
    return not any(c.__name__ in processed for m in model.modules() for c in type(m).__mro__)
