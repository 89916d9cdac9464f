"""Shared fixtures of molt-train's tests: the tiny model and one local Ray session."""

import os

import pytest

# Ray's token authentication is for shared clusters; these tests run a private local one.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from molt_rollout.engines.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen3"))


@pytest.fixture(scope="session")
def ray_cluster():
    """Started once for every test that needs it (about 2.5 s), with a small object store."""
    import ray

    if ray.is_initialized():  # another test directory's session fixture started it: share it
        yield
        return
    # "local": never the cluster a `ray start` elsewhere on this machine left behind.
    ray.init(address="local", num_cpus=2, object_store_memory=512 << 20,
             include_dashboard=False, log_to_driver=False)  # fmt: skip
    yield
    ray.shutdown()
