"""Molt's CUDA-IPC weight-transfer backend, engine side (`molt_ipc`), for an engine on the
trainer's GPU: each update names one of two staging buffers, mapped once and kept. A model with
nothing computed after loading takes a bucket in place, replaying its loader's first copies;
any other goes through vLLM's layerwise reload. Plain JSON handles, no pickle."""

import base64
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
from vllm.logger import init_logger

from molt_rollout.refit.buckets import BucketMeta, unpack

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: its handler writes the engine log

BACKEND = "molt_ipc"
_BYTES = ("handle", "ref_counter_handle", "event_handle")  # base64 in JSON
# torch's `_share_cuda_` tuple, field by field
_FIELDS = ("device", "handle", "size_bytes", "offset_bytes", "ref_counter_handle")
_FIELDS += ("ref_counter_offset", "event_handle", "event_sync_required")


def gpu_uuid(device: int | torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def share(buffer: torch.Tensor) -> dict:
    """A CUDA uint8 buffer's IPC handle as JSON fields (once per buffer: each call makes a
    reference the receiver must release)."""
    values = buffer.untyped_storage()._share_cuda_()
    fields = dict(zip(_FIELDS, values, strict=True))
    for key in _BYTES:  # the event handle is None where no event is needed
        fields[key] = None if fields[key] is None else base64.b64encode(fields[key]).decode()
    return {**fields, "numel": buffer.numel(), "gpu_uuid": gpu_uuid(buffer.device)}


def open_shared(fields: dict, device_index: int) -> torch.Tensor:
    """The buffer `share` described, mapped on this process's index of the same GPU."""
    if fields["gpu_uuid"] != gpu_uuid(device_index):
        raise ValueError(
            f"{BACKEND}: the trainer's buffer is on GPU {fields['gpu_uuid']}, this engine on "
            f"{gpu_uuid(device_index)}: CUDA IPC needs both on one GPU (--train.colocate)"
        )
    raw = {
        k: base64.b64decode(v) if k in _BYTES and v is not None else v for k, v in fields.items()
    }
    # _FIELDS' order: the reference counter's and the event's fields last, as torch takes them
    _, handle, size, offset, *counter_and_event = (raw[key] for key in _FIELDS)
    storage = (torch.UntypedStorage, torch.uint8, device_index, handle, size, offset, False)
    shape = torch.Size([raw["numel"]])
    return rebuild_cuda_tensor(torch.Tensor, shape, (1,), 0, *storage, *counter_and_event)


@dataclass
class BufferUpdateInfo(WeightTransferUpdateInfo, BucketMeta):
    # `share` of a staging buffer, with its slot (a default: after BucketMeta's)
    buffer: dict = None


class BufferIpcEngine(IPCWeightTransferEngine):
    """vLLM's IPC engine (its per-tensor handles still accepted: benchmarks/refit_vs_vllm.py
    compares the two) plus updates that name a staging buffer, kept mapped between refits."""

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
            # parameter (the rebuild was most of a refit: docs/performance.md).
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
        # same layout replay its copies in one call (its Python per tensor was most of a
        # refit: docs/performance.md).
        shapes = tuple(map(tuple, update_info.shapes))
        key = (slot, tuple(update_info.names), tuple(update_info.dtype_names), shapes)
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
    """Keeps a weight load's copies from the staging buffer into the model's tensors; anything
    else that writes makes the load not replayable."""

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
            from_staging = source.untyped_storage().data_ptr() == self.staging
            if from_staging and destination.untyped_storage().data_ptr() in self.model_storages:
                self.copies.append((destination, source))
                return out
        if func._schema.is_mutable:
            self.replayable = False
        return out


def record_copies(model: torch.nn.Module, weights: list, staging: torch.Tensor) -> list | None:
    """Loads `weights` (views of `staging`) through the model's loader: [destinations, sources]
    to replay with one `_foreach_copy_`, or None where the loader did more than copy."""

    def storages() -> set[int]:
        return {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

    before = storages()
    recorder = _CopyRecorder(staging, before)
    with recorder:
        model.load_weights(weights)
    # a loader that rebinds a parameter (`param.data = ...`) did what no copy replays
    replayable = recorder.replayable and recorder.copies and storages() == before
    if not replayable:
        logger.info("%s: a bucket keeps vLLM's loader: it does more than copy", BACKEND)
        return None
    logger.info("%s: a bucket loads by replaying %d copies", BACKEND, len(recorder.copies))
    destinations, sources = map(list, zip(*recorder.copies, strict=True))
    return [destinations, sources]


def loads_in_place(model: torch.nn.Module, vllm_config) -> bool:
    """Whether nothing is computed from the weights after loading (no quantization, fp8 KV
    cache, fused-MoE layouts or MLA absorption): then they may be copied in place."""
    if vllm_config.model_config.quantization or vllm_config.cache_config.cache_dtype != "auto":
        return False
    # By class name along each module's bases: where the classes live differs between versions.
    processed = {"FusedMoE", "MLAAttention"}
    return not any(c.__name__ in processed for m in model.modules() for c in type(m).__mro__)
