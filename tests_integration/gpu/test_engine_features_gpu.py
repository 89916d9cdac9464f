"""Engine features on GPU: CUDA graphs and prefix caching start and generate with versions, and
MoE routing replay end to end (`--vllm.enable_return_routed_experts` + `--train.routing_replay`)
lowers the engine/trainer mismatch."""

import json
import os
import subprocess
import sys

import httpx
import pytest

from molt_rollout.client import GENERATE_PATH

pytestmark = pytest.mark.gpu
PROMPT = list(range(10, 74))


def test_cuda_graphs_and_prefix_caching_generate(gpu_ray, tiny_model, tmp_path):
    from molt_rollout.config import RefitConfig, RouterConfig, VLLMConfig
    from molt_rollout.refit import EngineControl
    from molt_rollout.service import RolloutService

    vllm = VLLMConfig(enforce_eager=False, enable_prefix_caching=True, dtype="bfloat16",
                      gpu_memory_utilization=0.2, max_model_len=2048, startup_timeout_s=500)  # fmt: skip
    # No refit rendezvous: NCCL between this process and an engine on the same GPU is invalid
    # usage (it failed so on the H200); generation alone is under test.
    service = RolloutService.start(tiny_model, vllm, RouterConfig(), RefitConfig(), str(tmp_path),
                                   on_gpu=True, with_refitter=False)  # fmt: skip
    try:
        for url in service.engine_urls:  # what the refitter's set_version(0) would have done
            EngineControl(url, 30).post("/update_weight_version", {"new_version": "0"})
        body = {"model": service.model, "token_ids": PROMPT,
                "sampling_params": {"max_tokens": 32, "temperature": 0.0, "logprobs": 0}}  # fmt: skip
        replies = [httpx.post(service.router.url + GENERATE_PATH, json=body, timeout=120).json()
                   for _ in range(2)]  # fmt: skip
        first, second = (r["choices"][0] for r in replies)
        assert first["token_ids"] == second["token_ids"] and len(first["token_ids"]) == 32
        assert [s["version"] for s in first["weight_versions"]] == ["0"]
        log = (tmp_path / "engine_0.log").read_text()
        assert "--enforce-eager" not in log.splitlines()[0]  # CUDA graphs were on
    finally:
        service.shutdown()


def run_moe(tmp_path, name: str, *flags: str) -> list[dict]:
    from molt_rollout.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "moe", moe=True)
    cmd = [sys.executable, "-m", "molt_train.cli", "quickstart", "--train.colocate",
           "--actor.num_workers", "1", "--actor.model_path", str(model), "--vllm.dtype",
           "bfloat16", "--vllm.enforce_eager", "--vllm.enable_return_routed_experts",
           "--train.num_steps", "4", "--eval.every_steps", "0", "--logger.wandb_mode",
           "disabled", "--train.output_dir", str(tmp_path), "--logger.run_name", name, *flags]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, RAY_AUTH_MODE="disabled"))  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]


def test_routing_replay_lowers_the_mismatch(tmp_path):
    replayed = run_moe(tmp_path, "replay", "--train.routing_replay")
    free = run_moe(tmp_path, "free")
    with_replay = [r["is/vllm_kl"] for r in replayed]
    without = [r["is/vllm_kl"] for r in free]
    print("is/vllm_kl with routing replay:", with_replay, "without:", without)
    assert sum(with_replay) < sum(without)
