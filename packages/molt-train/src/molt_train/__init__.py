"""molt-train: the FSDP2 policy actor, the asynchronous RL loop and the molt-train CLI."""

__version__ = "0.1.0"
