"""Molt's CUDA-IPC weight-transfer backend, for an engine on the trainer's own GPU (colocated).

vLLM's own `ipc` backend shares every tensor of every refit by a fresh CUDA-IPC handle, pickled
over HTTP, and the engine maps and unmaps the trainer's memory for each one. Here the trainer
copies each bucket into one of two staging buffers (slots, used in turn: it fills one while the
engine loads from the other), each shared once; every `update_weights` call names its buffer
(the same handle each time) and the bucket's layout (buckets.py). The engine maps each slot's
buffer on first sight and keeps it mapped until the trainer replaces it. A model with nothing
computed after loading takes each bucket in place, through its own loader the first time and
by replaying that loader's copies afterwards; others copy the bucket out and load it through
vLLM's layerwise reload, like every other backend. The handle travels as plain JSON fields:
no pickle, so the engine needs no VLLM_ALLOW_INSECURE_SERIALIZATION.

Engine side: `BufferIpcEngine`, registered by Molt's vLLM plugin (vllm_plugin.py), created by
`--weight-transfer-config '{"backend": "molt_ipc"}'`. Trainer side: `molt_rollout.refit.IpcTransport`.
"""

import base64
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
from vllm.logger import init_logger

from molt_rollout.buckets import BucketMeta, unpack

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: its handler writes the engine log

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
    # `share` of a staging buffer, with its slot (a default: after BucketMeta's)
    buffer: dict = None


class BufferIpcEngine(IPCWeightTransferEngine):
    """vLLM's IPC engine (layerwise reload in start/finish, its per-tensor handles still
    accepted: benchmarks/refit_ipc.py compares the two on one engine) plus updates that name
    one of the trainer's staging buffers, each kept mapped between refits."""

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.staging: dict[int, tuple[str, torch.Tensor]] = {}  # slot: (handle, mapped buffer)
        self.reloading: bool | None = None  # this update's load path, set by its first bucket
        # per slot and bucket layout: the copies vLLM's loader made from that slot's buffer
        # (None: not replayable), valid while the same buffer stays mapped
        self.plans: dict[tuple, list | None] = {}

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
        slot = fields["slot"]
        mapped = self.staging.get(slot)
        if mapped is None or mapped[0] != fields["handle"]:  # new, or the trainer grew it
            self.staging.pop(slot, None)  # unmapped first: the trainer frees it at its next growth
            self.plans = {key: plan for key, plan in self.plans.items() if key[0] != slot}
            self.staging[slot] = (fields["handle"], open_shared(fields, self.device.index))
        staging = self.staging[slot][1]
        bucket = staging[: update_info.numbytes()]
        if self.reloading:  # it holds a layer's tensors until the layer is complete, maybe
            self.model.load_weights(unpack(bucket.clone(), update_info))  # after a refill
            return
        # In place: vLLM's loader runs once per bucket layout, recorded; later refits with the
        # same layout replay its copies in one call (its Python, 0.1 ms a tensor, was most of a
        # 4 GB refit on an H200: docs/benchmarks.md).
        if not update_info.names:
            return
        key = (slot, tuple(update_info.names), tuple(update_info.dtype_names),
               tuple(map(tuple, update_info.shapes)))  # fmt: skip
        if key not in self.plans:
            self.plans[key] = record_copies(self.model, unpack(bucket, update_info), staging)
        elif self.plans[key] is None:
            self.model.load_weights(unpack(bucket, update_info))
        else:
            destinations, sources = self.plans[key]
            torch._foreach_copy_(destinations, sources)
        # The base class's update_weights then synchronizes: the trainer refills after the reply.

    def shutdown(self) -> None:
        self.staging, self.plans = {}, {}


class _CopyRecorder(TorchDispatchMode):
    """Sees every tensor operation of a weight load: keeps its copies from the staging buffer
    into the model's tensors, and marks the load not replayable on anything else that writes
    (a copy of a computed tensor, an in-place op such as zeroing a padding)."""

    def __init__(self, staging: torch.Tensor, model_storages: set[int]) -> None:
        super().__init__()
        self.staging = staging.untyped_storage().data_ptr()
        self.model_storages = model_storages
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.replayable = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.copy_.default:
            destination, source = args[0], args[1]
            if (source.untyped_storage().data_ptr() == self.staging
                    and destination.untyped_storage().data_ptr() in self.model_storages):  # fmt: skip
                self.copies.append((destination, source))
                return out
        if func._schema.is_mutable:
            self.replayable = False
        return out


def record_copies(model: torch.nn.Module, weights: list, staging: torch.Tensor) -> list | None:
    """Loads `weights` (views of `staging`) through the model's own loader, recording it:
    [destinations, sources] to replay with one `_foreach_copy_`, or None where the loader did
    more than copy from the buffer into the model."""

    def storages() -> set[int]:
        return {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

    before = storages()
    recorder = _CopyRecorder(staging, before)
    with recorder:
        model.load_weights(weights)
    # a loader that rebinds a parameter (`param.data = ...`) did what no copy replays
    replayable = recorder.replayable and recorder.copies and storages() == before
    logger.info("%s: a bucket of %d tensors %s", BACKEND, len(weights),
                f"loads by replaying {len(recorder.copies)} copies from now on" if replayable
                else "keeps vLLM's loader: it does more than copy")  # fmt: skip
    if not replayable:
        return None
    destinations, sources = map(list, zip(*recorder.copies, strict=True))
    return [destinations, sources]


def loads_in_place(model: torch.nn.Module, vllm_config) -> bool:
    """Whether new weights may be copied straight into the model's parameters: nothing is
    computed from them after loading (no quantization, no fp8 KV-cache scales, no fused-MoE
    weight layouts, no MLA weight absorption). Otherwise vLLM's layerwise reload."""
    if vllm_config.model_config.quantization or vllm_config.cache_config.cache_dtype != "auto":
        return False
    # By class name along each module's bases: where the classes live differs between versions.
    processed = {"FusedMoE", "MLAAttention"}
    return not any(c.__name__ in processed for m in model.modules() for c in type(m).__mro__)
