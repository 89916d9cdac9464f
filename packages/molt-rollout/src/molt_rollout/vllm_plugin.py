"""Molt's vLLM general plugin: the `vllm.general_plugins` entry point `molt_weight_transfer`
runs `register()` in every vLLM process. It registers Molt's weight-transfer backends by module
path, so a process imports a backend's module only when its engine is started with it
(`--weight-transfer-config '{"backend": "..."}'`): registered, never patched in."""

import contextlib

BACKENDS = {
    "molt_gloo": ("molt_rollout.cpu_transport", "GlooWeightTransferEngine"),  # CPU engines
    "molt_ipc": ("molt_rollout.ipc_transport", "BufferIpcEngine"),  # an engine on the trainer's GPU
}


def register() -> None:
    """Runs once per vLLM process, possibly more: stays idempotent."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, (module, cls) in BACKENDS.items():
        with contextlib.suppress(ValueError):  # already registered in this process
            WeightTransferEngineFactory.register_engine(name, module, cls)
