"""molt-train: the FSDP2 policy actor, the asynchronous RL loop and the molt-train CLI."""

from molt_capture.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "molt_train.actor_config": ["ActorConfig", "FSDPConfig", "OptimConfig", "lr_at"],
    "molt_train.checkpoint": ["CheckpointManager"],
    "molt_train.model_group": ["ModelGroup"],
    "molt_train.packing": ["Sample"],
}
# Loaded on first use, so importing one submodule pays for that one alone (molt_capture.lazy).
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
