"""A dying engine is reported within seconds, with its own last log lines."""

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from molt_capture.types import SamplingParams
from molt_rollout.agent import Dropped
from molt_rollout.client import GenerationError, TokenClient
from molt_rollout.config import RolloutConfig, VLLMConfig
from molt_rollout.engine import EngineError, EngineGroup
from molt_rollout.loader import load_agent

AGENTS = Path(__file__).parent / "agents"
ROW = {"prompt": [{"role": "user", "content": "What is 1 plus 1?"}], "label": "2"}


def test_killed_engine_gives_clear_error_within_seconds(ray_cluster, tiny_model, tmp_path):
    cfg = VLLMConfig(num_engines=1, max_model_len=1024, dtype="float32", startup_timeout_s=300)
    engines = EngineGroup(cfg, tiny_model, "molt_gloo", str(tmp_path), on_gpu=False)
    (url,) = engines.start()
    try:
        engines.check()  # alive
        (pid,) = engines.pids()
        os.killpg(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineError) as error:
            while time.monotonic() - start < 10:
                engines.check()
                time.sleep(0.1)
        assert time.monotonic() - start < 10
        message = str(error.value)
        assert "engine 0" in message and "exited with code" in message
        assert "last log lines of" in message and "engine_0.log" in message
        assert "/health" in message  # the engine's own output

        async def generate():
            client = TokenClient(url, tiny_model, timeout_s=10, max_retries=2, backoff_s=0.1)
            try:
                await client([1, 2, 3], SamplingParams(max_tokens=4), "dead")
            finally:
                await client.aclose()

        start = time.monotonic()
        with pytest.raises(GenerationError, match="after 3 attempts"):
            asyncio.run(generate())
        assert time.monotonic() - start < 5

        # A rollout on the dead engine drops, counted as `engine_error`, in both agent forms.
        tokenizer = AutoTokenizer.from_pretrained(tiny_model)
        for agent in ("single_turn_env.py", "openai_chat_agent.py"):
            client = TokenClient(url, tiny_model, timeout_s=10, max_retries=1, backoff_s=0.1)
            runner = load_agent(str(AGENTS / agent))(client, tokenizer, RolloutConfig(max_len=512))
            try:
                dropped = asyncio.run(runner.run(ROW, rollout_id="r0", group_id="g0"))
            finally:
                runner.close()
            assert isinstance(dropped, Dropped) and dropped.reason == "engine_error", dropped
    finally:
        engines.shutdown()


def test_engine_that_cannot_start_reports_its_log(ray_cluster, tmp_path):
    cfg = VLLMConfig(num_engines=1, startup_timeout_s=120)
    engines = EngineGroup(
        cfg, str(tmp_path / "no-such-model"), "molt_gloo", str(tmp_path), on_gpu=False
    )
    try:
        with pytest.raises(EngineError, match="exited with code") as error:
            engines.start()
        assert "no-such-model" in str(error.value)
    finally:
        engines.shutdown()
