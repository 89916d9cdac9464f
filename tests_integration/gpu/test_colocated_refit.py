"""One vLLM CUDA engine and a trainer process on one GPU (`--train.colocate`): weights move
through a staging buffer shared by CUDA-IPC handle (molt_ipc: molt_rollout.refit.control.IpcTransport,
molt_rollout.refit.ipc_transport), versions label tokens on every vLLM."""

import asyncio

import httpx
import pytest
import torch

from molt_capture.types import SamplingParams
from molt_rollout.agents.agent import Env, EnvState, Result
from molt_rollout.engines.client import GENERATE_PATH

pytestmark = pytest.mark.gpu
PROMPT = list(range(10, 74))


@pytest.fixture(scope="module")
def colocated(gpu_ray, tiny_model, tmp_path_factory):
    """(service, trainer actor): the engine and a trainer sharing bundle 0's GPU."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from molt_rollout.config import RefitConfig, RouterConfig, VLLMConfig
    from molt_rollout.engines.engine import gpu_bundles
    from molt_rollout.engines.service import RolloutService

    bundles = gpu_bundles(1)
    vllm = VLLMConfig(enforce_eager=True, gpu_memory_utilization=0.2, dtype="bfloat16",
                      max_model_len=4096, startup_timeout_s=400)  # fmt: skip
    service = RolloutService.start(tiny_model, vllm, RouterConfig(), RefitConfig(),
                                   str(tmp_path_factory.mktemp("logs")), on_gpu=True,
                                   with_refitter=False, placement=bundles)  # fmt: skip
    try:
        trainer = (
            ray.remote(Trainer)
            .options(num_gpus=0.5, scheduling_strategy=PlacementGroupSchedulingStrategy(
                bundles, placement_group_bundle_index=0))
            .remote(tiny_model, service.engine_urls)
        )  # fmt: skip
        ray.get(trainer.ready.remote(), timeout=300)
        yield service, trainer
        ray.kill(trainer)
    finally:
        service.shutdown()
        ray.util.remove_placement_group(bundles)


class Trainer:
    """A process holding the model on the engine's GPU, as the policy's rank 0 does."""

    def __init__(self, model_path: str, urls: list[str]) -> None:
        from safetensors.torch import load_file

        from molt_rollout.config import RefitConfig
        from molt_rollout.refit.control import Refitter

        self.model_path = model_path
        self.original = {k: v.cuda().bfloat16() for k, v in
                         load_file(f"{model_path}/model.safetensors").items()}  # fmt: skip
        self.refitter = Refitter(urls, 1, RefitConfig(bucket_mb=1), on_gpu=True, colocated=True)
        self.refitter.init_transfer()
        self.refitter.set_version(0)
        self.weights = self.original

    def ready(self) -> str:
        return type(self.refitter.transport).__name__

    def refit(self, version: int, noise: float, seed: int = 0) -> dict:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.weights = {
            k: (v + noise * torch.randn(v.shape, generator=gen, device="cuda", dtype=v.dtype))
            if noise and "lm_head" in k else v
            for k, v in self.original.items()
        }  # fmt: skip
        return self.refitter.refit(iter(self.weights.items()), version)

    def logprobs(self, prompt: list[int], completion: list[int]) -> list[float]:
        """transformers' log-probs of `completion` under the weights last sent."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.bfloat16)
        model.load_state_dict({k: v for k, v in self.weights.items()}, strict=False)
        model = model.cuda().eval()
        ids = torch.tensor([prompt + completion], device="cuda")
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        picked = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])
        return picked.squeeze(1).tolist()


def generate(service, max_tokens: int = 16) -> dict:
    body = {"model": service.model, "token_ids": PROMPT,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "logprobs": 0}}  # fmt: skip
    reply = httpx.post(service.engine_urls[0] + GENERATE_PATH, json=body, timeout=120)
    reply.raise_for_status()
    return reply.json()["choices"][0]


def test_ipc_refit_changes_weights_and_labels_versions(colocated):
    import ray

    service, trainer = colocated
    assert ray.get(trainer.ready.remote()) == "IpcTransport"
    before = generate(service)
    assert [s["version"] for s in before["weight_versions"]] == ["0"]

    times = ray.get(trainer.refit.remote(1, noise=0.5), timeout=300)
    assert times["refit/buckets"] >= 1
    after = generate(service)
    assert after["token_ids"] != before["token_ids"]
    assert [s["version"] for s in after["weight_versions"]] == ["1"]
    # The engine serves exactly the weights sent: its log-probs are transformers' on them.
    engine = [e["logprob"] for e in after["logprobs"]["content"]]
    reference = ray.get(trainer.logprobs.remote(PROMPT, after["token_ids"]), timeout=300)
    assert max(abs(a - b) for a, b in zip(engine, reference, strict=True)) < 0.1  # bf16

    ray.get(trainer.refit.remote(2, noise=0.0), timeout=300)
    restored = generate(service)
    assert restored["token_ids"] == before["token_ids"]  # bitwise: the same weights again
    assert [e["logprob"] for e in restored["logprobs"]["content"]] == [
        e["logprob"] for e in before["logprobs"]["content"]
    ]


def test_token_client_resends_a_request_a_refit_overlapped(colocated):
    """A request in flight across a refit comes back labelled with one version, the one that
    generated all of it (0.26: re-sent; later vLLMs: per-token spans)."""
    import ray

    service, trainer = colocated

    async def long_generation():
        client = service.token_client()
        try:
            params = SamplingParams(max_tokens=3000, temperature=1.0)
            return await client(PROMPT, params, "overlap"), client.version_races
        finally:
            await client.aclose()

    start = ray.get(trainer.refit.remote(10, noise=0.0), timeout=300)["timing/refit_total"]
    assert start > 0

    async def run():
        task = asyncio.create_task(long_generation())
        await asyncio.sleep(0.3)  # the request is generating (3000 tokens take seconds)
        await asyncio.to_thread(ray.get, trainer.refit.remote(11, noise=0.0), timeout=300)
        return await task

    generation, races = asyncio.run(run())
    versions = generation.weight_versions
    assert len(generation.token_ids) == len(generation.logprobs) == len(versions)
    assert versions == sorted(versions) and set(versions) <= {10, 11}
    if races:  # re-sent after the refit: generated by version 11 alone
        assert set(versions) == {11}
    print(
        f"overlapping request: {len(versions)} tokens, versions {sorted(set(versions))}, "
        f"re-sent {races} times"
    )


def test_refit_timings_are_reported(colocated):
    import ray

    _, trainer = colocated
    times = [ray.get(trainer.refit.remote(20 + i, noise=0.0), timeout=300) for i in range(3)]
    for t in times:
        for phase in ("pause", "start", "transfer", "finish", "resume", "total"):
            assert t[f"timing/refit_{phase}"] >= 0
        assert 0 < t["timing/refit_transfer_engines"] <= t["timing/refit_transfer"]
    print("refit timings (tiny model):", times[-1])


class TwoTurns(Env):
    """The first reply gets a text observation; the second ends the rollout."""

    async def step(self, state: EnvState) -> Result:
        if state.turn == 0:
            return Result(reward=0.0, observation=" and then?", terminated=False)
        return Result(reward=1.0)


def test_trained_ids_are_the_generated_ids(colocated):
    """A two-turn Env rollout on the CUDA engine through the runners' token client (sampled at
    temperature 1): every generated turn is in the trace with its ids, log-probs and version,
    the trainer's packed row trains exactly those ids, and its log-probs on them are the
    engine's (the weights sent at version 30, bf16)."""
    import ray
    from transformers import PreTrainedTokenizerFast

    from molt_capture.testing import RecordingGenerator, assert_token_exact
    from molt_rollout.agents.env_runner import EnvRunner
    from molt_rollout.config import RolloutConfig
    from molt_train.packing import Sample, pack

    service, trainer = colocated
    ray.get(trainer.refit.remote(30, noise=0.0), timeout=300)
    recorded = RecordingGenerator(service.token_client)

    async def rollout():
        class Runner(EnvRunner):
            env_class = TwoTurns

        tokenizer = PreTrainedTokenizerFast.from_pretrained(service.model)
        config = RolloutConfig(temperature=1.0, max_tokens=24, max_turns=2)
        row = {"prompt": [{"role": "user", "content": "Count with me."}]}
        try:
            return await Runner(recorded, tokenizer, config, True).run(row, "r0", "g0")
        finally:
            if recorded.generator is not None:
                await recorded.generator.aclose()

    result = asyncio.run(rollout())
    calls = recorded.calls
    assert len(calls) == 2 and result.reward == 1.0
    assert_token_exact(result.segments, calls)
    [seg] = result.segments
    assert set(v for span in seg.turns for v in seg.weight_versions[span.start : span.end]) == {30}

    batch = pack([Sample(token_ids=seg.token_ids, loss_mask=seg.trainable)])
    trained = batch.input_ids[0][batch.inputs.mask[0]].tolist()
    assert trained == [t for call in calls for t in call.generation.token_ids]
    # The trainer's view of the same row: its log-probs on the trained ids are the engine's.
    ids = batch.input_ids[0].tolist()
    reference = ray.get(trainer.logprobs.remote(ids[:1], ids[1:]), timeout=300)
    engine = [lp for lp, m in zip(seg.logprobs, seg.trainable, strict=True) if m]
    ours = [lp for lp, m in zip(reference, seg.trainable[1:], strict=True) if m]
    assert max(abs(a - b) for a, b in zip(engine, ours, strict=True)) < 0.1  # bf16
