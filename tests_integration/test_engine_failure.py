"""An engine that cannot start is reported with its own log. (A killed one: the last test of
test_adapter_refit.py, which kills that module's engine.)"""

import pytest

from molt_rollout.config import VLLMConfig
from molt_rollout.engines.engine import EngineError, EngineGroup


def test_engine_that_cannot_start_reports_its_log(ray_cluster, tmp_path):
    cfg = VLLMConfig(num_engines=1, startup_timeout_s=120, enforce_eager=True)
    engines = EngineGroup(
        cfg, str(tmp_path / "no-such-model"), "molt_gloo", str(tmp_path), on_gpu=False
    )
    try:
        with pytest.raises(EngineError, match="exited with code") as error:
            engines.start()
        assert "no-such-model" in str(error.value)
    finally:
        engines.shutdown()
