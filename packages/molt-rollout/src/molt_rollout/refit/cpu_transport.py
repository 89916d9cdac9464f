"""Molt's CPU weight-transfer backend, engine side (`molt_gloo`): vLLM's NCCL backend mirrored
over a gloo group, so the same refit runs on CPU engines (trainer side: control.GlooTransport)."""

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

from molt_rollout.refit.buckets import BucketMeta, unpack


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
    """One broadcast bucket per `update_weights` call, loaded through vLLM's layerwise reload
    (as the NCCL backend does): checkpoint-format weights, vLLM's own processing."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    group: dist.ProcessGroup | None = None  # set by init_transfer_engine

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        worker_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        info, timeout = init_info, timedelta(seconds=init_info.timeout_s)
        store = dist.TCPStore(
            info.master_address, info.master_port, info.world_size, False, timeout
        )
        rank = info.rank_offset + worker_rank
        self.group = dist.ProcessGroupGloo(store, rank, info.world_size, timeout)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), meaningless on CPU.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        buffer = torch.empty(update_info.numbytes(), dtype=torch.uint8)
        self.group.broadcast(buffer, 0).wait()
        self.model.load_weights(unpack(buffer, update_info))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.group = None
