"""Molt's CPU weight-transfer backend for vLLM, loaded through vLLM's plugin entry points.

vLLM's own transports (NCCL, CUDA IPC) need a GPU. This backend mirrors the NCCL one over a
gloo process group, so the same refit orchestration (init once; per refit start, update per
bucket, finish) runs on CPU engines in CI. It is registered by Molt's vLLM plugin
(vllm_plugin.py), and an engine started with `--weight-transfer-config '{"backend": "molt_gloo"}'`
creates it. The trainer side is `molt_rollout.refit.GlooTransport`.
"""

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from molt_rollout.buckets import BucketMeta, unpack

BACKEND = "molt_gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int  # this engine's first worker rank in the trainer + workers group
    world_size: int
    timeout_s: float = 120.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo, BucketMeta):
    pass


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives one broadcast bucket per `update_weights` call and loads it through vLLM's
    layerwise reload (the same path as the NCCL backend), so weights arrive in checkpoint
    (Hugging Face) format and vLLM applies its own fusing and processing."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroup | None = None
        self.loaded_names: set[str] = set()

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        worker_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        store = dist.TCPStore(
            init_info.master_address,
            init_info.master_port,
            init_info.world_size,
            is_master=False,
            timeout=timedelta(seconds=init_info.timeout_s),
        )
        self.group = dist.ProcessGroupGloo(
            store,
            init_info.rank_offset + worker_rank,
            init_info.world_size,
            timedelta(seconds=init_info.timeout_s),
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.loaded_names = set()
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), meaningless on CPU.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("molt_gloo weight transfer is not initialised")
        buffer = torch.empty(update_info.numbytes(), dtype=torch.uint8)
        self.group.broadcast(buffer, 0).wait()
        self.model.load_weights(unpack(buffer, update_info))
        self.loaded_names.update(update_info.names)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.group = None
