"""Engine features on GPU: CUDA graphs and prefix caching start and generate with versions, and
MoE routing replay end to end (`--vllm.enable_return_routed_experts` + `--train.routing_replay`)
routes every token through the engine's experts."""

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


def flippable_moe(tmp_path) -> str:
    """The tiny MoE with every router's rows made nearly alike (the first row plus a thousandth
    of each own): a token's expert logits then differ by less than bf16 resolves, so the
    engine's arithmetic and the trainer's pick different experts for some tokens. (Scaling the
    weights would not do: relative rounding scales with them.)"""
    from safetensors.torch import load_file, save_file

    from molt_rollout.engines.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "moe", moe=True)
    weights = load_file(path / "model.safetensors")
    for name in [n for n in weights if n.endswith("mlp.gate.weight")]:
        weights[name] = weights[name][:1] + 1e-3 * weights[name]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_routing_replay_routes_every_token_as_the_engine_did(tmp_path, seed):
    """routing/agreement: the fraction of (token, MoE layer) pairs whose experts in the
    trainer's forwards are the engine's. Replayed: all of them, every step; not replayed: the
    near-tied routers flip some. is/vllm_kl of both is printed (docs/performance.md)."""
    model = flippable_moe(tmp_path)
    runs = {}
    for name, flags in (("replay", ["--train.routing_replay"]), ("free", [])):
        runs[name] = quickstart(tmp_path / name, "--actor.model_path", model,
                                "--vllm.enable_return_routed_experts", "--train.force_on_policy",
                                "--actor.freeze_moe_router",  # an update would end the near-tie
                                "--rollout.seed", str(seed), "--train.num_steps", "3",
                                "--eval.every_steps", "0", *flags)  # fmt: skip
    for name, rows in runs.items():
        print(f"seed {seed} {name}: routing/agreement",
              [r["routing/agreement"] for r in rows], "|is/vllm_kl|",
              [abs(r["is/vllm_kl"]) for r in rows])  # fmt: skip
    assert all(r["routing/agreement"] == 1.0 for r in runs["replay"]), runs["replay"]
    assert all(r["routing/agreement"] < 1.0 for r in runs["free"]), runs["free"]
