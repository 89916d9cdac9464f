"""molt-train: the FSDP2 policy actor, the asynchronous RL loop and the molt-train CLI."""

from molt_train.actor import (
    ActorConfig,
    ActorGroup,
    FSDPConfig,
    OptimConfig,
    lr_at,
    validate_actor_config,
)
from molt_train.checkpoint import CheckpointManager
from molt_train.packing import Sample

__version__ = "0.1.0"

__all__ = [
    "ActorConfig",
    "ActorGroup",
    "CheckpointManager",
    "FSDPConfig",
    "OptimConfig",
    "Sample",
    "lr_at",
    "validate_actor_config",
]
