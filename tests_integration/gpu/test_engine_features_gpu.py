"""Engine features on GPU: CUDA graphs and prefix caching start and generate with versions, and
MoE routing replay end to end (`--vllm.enable_return_routed_experts` + `--train.routing_replay`)
lowers the engine/trainer mismatch."""

import httpx
import pytest
from test_quickstart_gpu import quickstart

from molt_rollout.engines.client import GENERATE_PATH

pytestmark = pytest.mark.gpu
PROMPT = list(range(10, 74))


def test_cuda_graphs_and_prefix_caching_generate(gpu_ray, tiny_model, tmp_path):
    from molt_rollout.config import RefitConfig, RouterConfig, VLLMConfig
    from molt_rollout.engines.service import RolloutService
    from molt_rollout.refit.control import EngineControl

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
    from molt_rollout.engines.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "moe", moe=True)
    return quickstart(tmp_path / name, "--actor.model_path", str(model),
                      "--vllm.enable_return_routed_experts", "--train.force_on_policy",
                      "--train.num_steps", "4", "--eval.every_steps", "0", *flags)  # fmt: skip


def test_routing_replay_lowers_the_mismatch(tmp_path):
    replayed = run_moe(tmp_path, "replay", "--train.routing_replay")
    free = run_moe(tmp_path, "free")
    # on-policy, so every step's tokens are at version match and every step has a vllm_kl
    with_replay = [abs(r["is/vllm_kl"]) for r in replayed]
    without = [abs(r["is/vllm_kl"]) for r in free]
    print("|is/vllm_kl| with routing replay:", with_replay, "without:", without)
    assert sum(with_replay) < sum(without)
