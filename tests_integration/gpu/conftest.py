"""GPU tests: vLLM CUDA engines beside a trainer on the same GPU. Skipped without CUDA; how to run
them on a CUDA machine: docs/development.md."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests_integration/gpu/" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_ray():
    """A private Ray with the one GPU these tests share."""
    import ray

    if not ray.is_initialized():
        ray.init(num_gpus=1, object_store_memory=1 << 30, include_dashboard=False,
                 log_to_driver=False)  # fmt: skip
    yield
    ray.shutdown()
