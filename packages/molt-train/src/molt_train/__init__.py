"""molt-train: the FSDP2 policy actor, the asynchronous RL loop and the molt-train CLI."""

from molt_train.actor_config import (
    ActorConfig,
    FSDPConfig,
    OptimConfig,
    lr_at,
    validate_actor_config,
)
from molt_train.checkpoint import CheckpointManager
from molt_train.model_group import ModelGroup
from molt_train.packing import Sample

__version__ = "0.1.0"

__all__ = [
    "ActorConfig",
    "CheckpointManager",
    "FSDPConfig",
    "ModelGroup",
    "OptimConfig",
    "Sample",
    "lr_at",
    "validate_actor_config",
]
