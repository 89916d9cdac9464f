"""Molt's vLLM general plugin (entry point `molt_weight_transfer`), run in every vLLM process: it
registers Molt's weight-transfer backends by module path, so a process imports one only when
its engine is started with it (`--weight-transfer-config`). Registered, never patched in."""

import contextlib

BACKENDS = {
    "molt_gloo": ("molt_rollout.refit.cpu_transport", "GlooWeightTransferEngine"),  # CPU engines
    "molt_ipc": ("molt_rollout.refit.ipc_transport", "BufferIpcEngine"),  # on the trainer's GPU
}


def register() -> None:
    """Runs once per vLLM process, possibly more: stays idempotent."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, (module, cls) in BACKENDS.items():
        with contextlib.suppress(ValueError):  # already registered in this process
            WeightTransferEngineFactory.register_engine(name, module, cls)
