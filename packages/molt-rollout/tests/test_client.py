"""The token client: parsing vLLM's generate replies, and the request loop (session header,
version-salted prefix cache, retries, timeouts, refit races) against a scripted fake engine."""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import time

import pytest

from molt_capture.errors import ParamRejected
from molt_capture.types import Generation, SamplingParams
from molt_rollout.engines.client import (
    GENERATE_PATH,
    MAX_VERSION_RACES,
    GenerationError,
    TokenClient,
    parse_generation,
)

MODEL = "tiny-qwen3"
GENERATE, WEIGHT_INFO = GENERATE_PATH, "/weight_info"  # the fake engine's two routes


def vllm_reply(**choice_overrides) -> dict:
    """A token-in/token-out reply as vLLM writes it: 5 tokens, a refit after the second."""
    choice = {
        "index": 0,
        "token_ids": [17, 4, 250, 9, 2],
        "logprobs": {
            "content": [
                {"token_id": 17, "logprob": -0.25, "top_logprobs": []},
                {"token_id": 4, "logprob": -1.5, "top_logprobs": []},
                {"token_id": 250, "logprob": 0.0, "top_logprobs": []},
                {"token_id": 9, "logprob": -3.0625, "top_logprobs": []},
                {"token_id": 2, "logprob": -0.125, "top_logprobs": []},
            ]
        },
        "finish_reason": "length",
        "stop_reason": None,
        "weight_versions": [
            {"version": "default", "start": 0, "end": 2},
            {"version": "3", "start": 2, "end": 5},
        ],
        "routed_experts": None,
    }
    choice.update(choice_overrides)
    return {"id": "gen-0", "object": "generate", "model": MODEL, "choices": [choice]}


# --- parse_generation -----------------------------------------------------------------------


def test_parse_realistic_reply():
    gen = parse_generation(vllm_reply())
    assert isinstance(gen, Generation)
    assert gen.token_ids == [17, 4, 250, 9, 2]
    assert gen.logprobs == [-0.25, -1.5, 0.0, -3.0625, -0.125]
    assert all(type(lp) is float for lp in gen.logprobs)
    assert gen.weight_versions == [0, 0, 3, 3, 3]  # "default" is version 0
    assert gen.finish_reason == "length"
    assert gen.stop_reason is None
    assert gen.routed_experts is None


def test_parse_stop_reasons_and_missing_finish_reason():
    gen = parse_generation(vllm_reply(finish_reason="stop", stop_reason="</answer>"))
    assert (gen.finish_reason, gen.stop_reason) == ("stop", "</answer>")
    gen = parse_generation(vllm_reply(finish_reason="stop", stop_reason=151645))
    assert gen.stop_reason == 151645
    assert parse_generation(vllm_reply(finish_reason=None)).finish_reason == "stop"


def test_parse_single_version_and_many_spans():
    gen = parse_generation(vllm_reply(weight_versions=[{"version": "12", "start": 0, "end": 5}]))
    assert gen.weight_versions == [12] * 5
    spans = [{"version": str(v), "start": i, "end": i + 1} for i, v in enumerate([4, 5, 6, 7, 8])]
    assert parse_generation(vllm_reply(weight_versions=spans)).weight_versions == [4, 5, 6, 7, 8]


def test_parse_skips_empty_spans():
    """vLLM opens a span when the version changes, so two refits before the first token leave
    an empty span first."""
    spans = [
        {"version": "1", "start": 0, "end": 0},
        {"version": "2", "start": 0, "end": 4},
        {"version": "3", "start": 4, "end": 5},
    ]
    assert parse_generation(vllm_reply(weight_versions=spans)).weight_versions == [2, 2, 2, 2, 3]


def test_parse_empty_generation():
    gen = parse_generation(
        vllm_reply(token_ids=[], logprobs={"content": []}, weight_versions=[], finish_reason="stop")
    )
    assert gen.token_ids == [] and gen.logprobs == [] and gen.weight_versions == []


def test_parse_keeps_routed_experts_rows_and_drops_empty():
    rows = [[[i % 8, (i + 1) % 8], [i % 4, 7]] for i in range(4)]  # 5 tokens: 4 were run
    assert parse_generation(vllm_reply(routed_experts=rows)).routed_experts == rows
    assert parse_generation(vllm_reply(routed_experts=[])).routed_experts is None
    with pytest.raises(GenerationError, match="5 routed-expert rows from position 0"):
        parse_generation(vllm_reply(routed_experts=rows + rows[:1]))


def test_parse_routed_experts_in_vllm_wire_format():
    np = pytest.importorskip("numpy")
    # A 6-token prompt of which the caller holds the routing of 4: rows for prompt positions
    # 4 and 5, then the first 4 of the 5 sampled tokens.
    routing = np.arange(6 * 2 * 2, dtype=np.uint8).reshape(6, 2, 2) % 8
    with io.BytesIO() as buffer:
        np.save(buffer, routing, allow_pickle=False)
        encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    gen = parse_generation(vllm_reply(routed_experts=encoded), prompt_len=6, routing_start=4)
    assert gen.routed_experts == routing.tolist() and gen.routing_start == 4


@pytest.mark.parametrize(
    "logprobs",
    [
        {"content": [{"token_id": 17, "logprob": -0.25}] * 4},
        {"content": [{"token_id": 17, "logprob": -0.25}] * 6},
        {"content": []},
        {"content": None},
        None,
    ],
    ids=["fewer", "more", "empty", "content-null", "null"],
)
def test_parse_rejects_logprob_count_mismatch(logprobs):
    with pytest.raises(GenerationError, match="5 tokens but"):
        parse_generation(vllm_reply(logprobs=logprobs))


@pytest.mark.parametrize(
    "spans",
    [
        [{"version": "default", "start": 0, "end": 2}],
        [{"version": "default", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 6}],
        [],
        None,
    ],
    ids=["short", "long", "empty", "null"],
)
def test_parse_rejects_version_span_coverage_mismatch(spans):
    with pytest.raises(GenerationError, match="weight-version spans cover"):
        parse_generation(vllm_reply(weight_versions=spans))


def test_parse_rejects_spans_that_do_not_tile_the_output():
    spans = [{"version": "1", "start": 0, "end": 2}, {"version": "3", "start": 3, "end": 6}]
    with pytest.raises(GenerationError):
        parse_generation(vllm_reply(weight_versions=spans))


def test_parse_does_not_mutate_the_reply():
    reply = vllm_reply()
    before = copy.deepcopy(reply)
    gen = parse_generation(reply)
    gen.token_ids.append(1)
    assert reply == before


# --- TokenClient against the fake engine -----------------------------------------------------


def make_client(url: str, **kw) -> TokenClient:
    return TokenClient(url, MODEL, **{"backoff_s": 0.001, "timeout_s": 10.0, **kw})


def generate(client: TokenClient, tokens=(1, 2, 3), params=None, session_id="rollout-7"):
    """One call on a fresh event loop; the client is closed afterwards."""
    params = params or SamplingParams(max_tokens=8)

    async def main():
        try:
            return await client(list(tokens), params, session_id)
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_request_carries_session_salt_and_sampling_params(engine):
    engine.versions = ["4"]
    params = SamplingParams(max_tokens=2, temperature=0.7, top_p=0.9, stop=["</s>", "\n\n"])
    gen = generate(make_client(engine.url + "/"), tokens=[5, 6, 7], params=params)
    # The reply is the fake's answer to exactly this request.
    assert gen.token_ids == [105, 106]
    assert gen.logprobs == [-0.125, -0.25]
    assert gen.weight_versions == [4, 4]
    assert gen.finish_reason == "length"
    assert [c.path for c in engine.calls] == [WEIGHT_INFO, GENERATE]  # version read first
    for call in engine.calls:
        assert call.headers["x-session-id"] == "rollout-7"
    body = engine.calls[1].body
    assert body["model"] == MODEL
    assert body["token_ids"] == [5, 6, 7]
    assert body["cache_salt"] == "molt-v4"
    sp = body["sampling_params"]
    assert sp["max_tokens"] == 2 and sp["temperature"] == 0.7 and sp["top_p"] == 0.9
    assert sp["stop"] == ["</s>", "\n\n"]
    assert sp["logprobs"] == 0  # the sampled token's log-prob, no alternatives
    assert sp["skip_special_tokens"] is False
    assert sp["flat_logprobs"] is True
    assert sp["output_kind"] == 2  # vLLM's FINAL_ONLY: no output per step
    assert sp["detokenize"] is True  # stop strings are matched on text
    assert "seed" not in sp  # unseeded: the engine's own RNG


def test_a_seeded_request_carries_its_seed(engine):
    generate(make_client(engine.url), params=SamplingParams(max_tokens=2, seed=123))
    assert engine.calls[1].body["sampling_params"]["seed"] == 123


def test_a_request_without_stop_strings_is_not_detokenized(engine):
    generate(make_client(engine.url), params=SamplingParams(max_tokens=2))
    assert engine.calls[1].body["sampling_params"]["detokenize"] is False


def test_every_request_carries_the_runs_token(engine):
    generate(make_client(engine.url, token="run-secret"))
    assert [c.headers.get("authorization") for c in engine.calls] == ["Bearer run-secret"] * 2
    engine.reset()
    generate(make_client(engine.url))  # one node: no token, no header
    assert all("authorization" not in c.headers for c in engine.calls)


def test_initial_version_salts_as_zero(engine):
    gen = generate(make_client(engine.url))
    assert engine.generate_calls()[0].body["cache_salt"] == "molt-v0"
    assert gen.weight_versions == [0, 0, 0]


def test_concurrent_sessions_keep_their_own_headers(engine):
    client = make_client(engine.url)
    sessions = {f"session-{i}": [10 * i + 1, 10 * i + 2] for i in range(8)}

    async def main():
        try:
            params = SamplingParams(max_tokens=4)
            return await asyncio.gather(*(client(t, params, s) for s, t in sessions.items()))
        finally:
            await client.aclose()

    gens = asyncio.run(main())
    for tokens, gen in zip(sessions.values(), gens, strict=True):
        assert gen.token_ids == [t + 100 for t in tokens]
    posts = engine.generate_calls()
    assert len(posts) == 8
    for call in posts:
        assert sessions[call.headers["x-session-id"]] == call.body["token_ids"]


@pytest.mark.parametrize("codes", [(503,), (500, 502), (503, 504, 500)])
def test_transient_5xx_is_retried(engine, codes):
    engine.actions = [("status", code, "engine overloaded") for code in codes]
    gen = generate(make_client(engine.url, max_retries=3))
    assert gen.token_ids == [101, 102, 103]
    posts = engine.generate_calls()
    assert len(posts) == len(codes) + 1
    assert all(p.body == posts[0].body for p in posts)  # the same request, same salt
    assert len(engine.info_calls()) == 1  # retries resend the request, not the version read


@pytest.mark.parametrize("max_retries", [0, 2])
def test_persistent_5xx_raises_naming_the_url(engine, max_retries):
    engine.actions = [("status", 500, "CUDA error: device-side assert")] * 10
    client = make_client(engine.url, max_retries=max_retries)
    with pytest.raises(GenerationError) as info:
        generate(client)
    message = str(info.value)
    assert engine.url + GENERATE in message
    assert f"{max_retries + 1} attempts" in message
    assert "500" in message and "device-side assert" in message
    assert len(engine.generate_calls()) == max_retries + 1


def test_dropped_connection_is_retried(engine):
    engine.actions = ["drop", "drop"]
    gen = generate(make_client(engine.url, max_retries=2))
    assert gen.token_ids == [101, 102, 103]
    assert len(engine.generate_calls()) == 3


def test_persistent_dropped_connections_raise_naming_the_url(engine):
    engine.actions = ["drop"] * 10
    with pytest.raises(GenerationError) as info:
        generate(make_client(engine.url, max_retries=1))
    assert engine.url + GENERATE in str(info.value)
    assert "connection error" in str(info.value)
    assert len(engine.generate_calls()) == 2


def test_refused_connection_raises_naming_the_url(closed_port_url):
    with pytest.raises(GenerationError) as info:
        generate(make_client(closed_port_url, max_retries=2))
    assert closed_port_url + WEIGHT_INFO in str(info.value)
    assert "3 attempts" in str(info.value)


def test_weight_info_failures_are_retried(engine):
    engine.info_failures = 2
    engine.versions = ["6"]
    gen = generate(make_client(engine.url, max_retries=2))
    assert gen.weight_versions == [6, 6, 6]
    assert len(engine.info_calls()) == 3
    assert engine.generate_calls()[0].body["cache_salt"] == "molt-v6"


def test_backoff_grows_between_retries(engine):
    engine.actions = [("status", 503, "busy")] * 3
    start = time.monotonic()
    generate(make_client(engine.url, max_retries=3, backoff_s=0.05))
    assert time.monotonic() - start >= 0.05 + 0.1 + 0.2 - 0.01  # 0.05 * (1 + 2 + 4)


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (400, "This model's maximum context length is 2048 tokens"),
        (404, "The model `other` does not exist."),
        (422, "token_ids must not contain negative values"),
    ],
)
def test_4xx_fails_at_once_with_the_engine_message(engine, code, message):
    engine.actions = [("status", code, message)] * 5
    with pytest.raises(GenerationError) as info:
        generate(make_client(engine.url, max_retries=3))
    assert str(code) in str(info.value)
    assert message in str(info.value)
    assert len(engine.generate_calls()) == 1


def test_refused_sampling_parameter_is_named(engine):
    engine.actions = [("status", 400, "stop strings must not be empty")]
    with pytest.raises(ParamRejected) as info:
        generate(make_client(engine.url, max_retries=3))
    assert info.value.param == "stop" and "must not be empty" in info.value.message
    assert isinstance(info.value, GenerationError)


def test_request_timeout_raises(engine):
    engine.actions = [("sleep", 20.0)]
    client = make_client(engine.url, timeout_s=0.2, max_retries=3)
    start = time.monotonic()
    with pytest.raises(GenerationError, match="timed out") as info:
        generate(client)
    assert time.monotonic() - start < 10.0
    deadline = time.monotonic() + 5.0
    while engine.disconnects == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.disconnects == 1  # the client gave up on the request
    assert engine.url + GENERATE in str(info.value)
    assert len(engine.generate_calls()) == 1  # a timed-out generate is not re-sent


def test_malformed_reply_fails_without_retry(engine):
    bad = vllm_reply(logprobs={"content": []})
    engine.actions = [("reply", bad)] * 3
    with pytest.raises(GenerationError, match="log-probs"):
        generate(make_client(engine.url, max_retries=3))
    assert len(engine.generate_calls()) == 1


def test_version_race_resends_with_the_new_salt(engine):
    """A refit lands between the version read (1) and the prefill (first token at 2)."""
    engine.versions = ["1", "2"]
    engine.spans = [[{"version": "2", "start": 0, "end": 3}]]
    client = make_client(engine.url)
    gen = generate(client)
    assert gen.weight_versions == [2, 2, 2]
    assert [c.body["cache_salt"] for c in engine.generate_calls()] == ["molt-v1", "molt-v2"]
    assert [c.path for c in engine.calls] == [WEIGHT_INFO, GENERATE] * 2
    assert client.version_races == 1


def test_refit_after_the_first_token_is_not_a_race(engine):
    """A request kept in flight across a refit keeps its tokens: spans change mid-output."""
    engine.versions = ["1"]
    engine.spans = [
        [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 1, "end": 3}]
    ]
    client = make_client(engine.url)
    gen = generate(client)
    assert gen.weight_versions == [1, 2, 2]
    assert len(engine.generate_calls()) == 1
    assert client.version_races == 0


def test_persistent_version_races_keep_the_last_answer(engine):
    engine.versions = ["1"]
    engine.spans = [[{"version": "2", "start": 0, "end": 3}]] * 10
    client = make_client(engine.url)
    gen = generate(client)
    assert gen.weight_versions == [2, 2, 2]  # the tokens say which weights produced them
    assert len(engine.generate_calls()) == MAX_VERSION_RACES + 1
    assert client.version_races == MAX_VERSION_RACES + 1
    assert {c.body["cache_salt"] for c in engine.generate_calls()} == {"molt-v1"}


def test_version_races_count_across_calls(engine):
    engine.versions = ["1", "2", "2", "3"]
    engine.spans = [
        [{"version": "2", "start": 0, "end": 3}],  # race
        [{"version": "2", "start": 0, "end": 3}],  # ok
        [{"version": "3", "start": 0, "end": 3}],  # race
        [{"version": "3", "start": 0, "end": 3}],  # ok
    ]
    client = make_client(engine.url)
    first, second = generate_twice(client)
    assert first.weight_versions == [2, 2, 2] and second.weight_versions == [3, 3, 3]
    assert client.version_races == 2
    salts = [c.body["cache_salt"] for c in engine.generate_calls()]
    assert salts == ["molt-v1", "molt-v2", "molt-v2", "molt-v3"]


def generate_twice(client: TokenClient) -> list:
    """Two calls one after the other on one event loop; the client is closed afterwards."""
    params = SamplingParams(max_tokens=8)

    async def main():
        try:
            return [await client([1, 2, 3], params, "s") for _ in range(2)]
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_empty_generation_is_never_a_race(engine):
    engine.versions = ["1"]
    engine.spans = [[]]
    client = make_client(engine.url)
    gen = generate(client, params=SamplingParams(max_tokens=0))
    assert gen.token_ids == [] and gen.weight_versions == []
    assert client.version_races == 0 and len(engine.generate_calls()) == 1


def test_a_told_version_salts_requests_without_a_read(engine):
    """The driver tells the runners each refit's version: no /weight_info call per request."""
    engine.spans = [[{"version": "4", "start": 0, "end": 3}]]
    client = make_client(engine.url)
    client.tell_version(4)
    client.tell_version(3)  # late and out of order: never lowers it
    gen = generate(client)
    assert gen.weight_versions == [4, 4, 4]
    assert [c.path for c in engine.calls] == [GENERATE]
    assert engine.calls[0].body["cache_salt"] == "molt-v4"


def test_a_told_version_behind_the_engines_is_a_race_that_updates_it(engine):
    """A refit landed before the driver's word arrived: the reply's first token shows the
    engines' newer version, the request is re-sent salted with it, and it is kept."""
    engine.spans = [[{"version": "5", "start": 0, "end": 3}]] * 3
    client = make_client(engine.url)
    client.tell_version(4)
    first, second = generate_twice(client)
    assert first.weight_versions == second.weight_versions == [5, 5, 5]
    salts = [c.body["cache_salt"] for c in engine.generate_calls()]
    assert salts == ["molt-v4", "molt-v5", "molt-v5"]  # the second call needs no race
    assert client.version_races == 1 and client.version == 5
    assert WEIGHT_INFO not in [c.path for c in engine.calls]


def test_the_adapter_client_keeps_reading_the_version(engine):
    """Its request names the version's adapter, which must be loaded: it asks the engine."""
    engine.versions = ["3"]
    client = make_client(engine.url, adapter="molt-lora")
    client.tell_version(7)
    generate(client)
    assert [c.path for c in engine.calls] == [WEIGHT_INFO, GENERATE]
    assert engine.generate_calls()[0].body["model"] == "molt-lora-v3"


def test_parse_top_k_candidates():
    content = [
        # vLLM lists the sampled token first, then the top-k by rank (the sampled one again).
        {
            "token_id": 17,
            "logprob": -0.25,
            "top_logprobs": [
                {"token_id": 17, "logprob": -0.25, "rank": 1},
                {"token_id": 17, "logprob": -0.25},
                {"token_id": 3, "logprob": -2.0, "rank": 2},
                {"token_id": 8, "logprob": -2.5},
            ],
        },
        # A sampled token outside the head: k + 1 entries, the k best are kept.
        {
            "token_id": 4,
            "logprob": -4.0,
            "top_logprobs": [
                {"token_id": 4, "logprob": -4.0, "rank": 9},
                {"token_id": 5, "logprob": -0.1},
                {"token_id": 6, "logprob": -1.0},
                {"token_id": 7, "logprob": -3.0},
            ],
        },
    ]
    reply = vllm_reply(
        token_ids=[17, 4],
        logprobs={"content": content},
        weight_versions=[{"version": "1", "start": 0, "end": 2}],
    )
    gen = parse_generation(reply, top_k=3)
    assert gen.top_ids == [[17, 3, 8], [5, 6, 7]]
    assert gen.top_logprobs == [[-0.25, -2.0, -2.5], [-0.1, -1.0, -3.0]]
    assert parse_generation(reply).top_ids is None  # not asked: not kept
    with pytest.raises(GenerationError, match="none"):
        parse_generation(vllm_reply(), top_k=2)


# --- adapter refit: each request names its version's LoRA adapter ---------------------------


def test_adapter_mode_names_the_read_version_and_labels_every_token_with_it(engine):
    """The engine's version changes mid-request (its spans say 3, then 4), but the request
    named adapter v3, so every token is version 3's; and no version race is counted."""
    engine.versions = ["3"]
    engine.spans = [
        [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}]
    ]
    client = make_client(engine.url, adapter="molt-lora")
    gen = generate(client)
    assert gen.weight_versions == [3, 3, 3]
    (call,) = engine.generate_calls()
    assert call.body["model"] == "molt-lora-v3" and call.body["cache_salt"] == "molt-v3"
    assert client.version_races == 0


def test_adapter_mode_starts_at_the_version_0_adapter(engine):
    gen = generate(make_client(engine.url, adapter="molt-lora"))
    assert engine.generate_calls()[0].body["model"] == "molt-lora-v0"
    assert gen.weight_versions == [0, 0, 0]


def test_an_unloaded_adapter_is_asked_for_again_at_the_current_version(engine):
    """The adapter left the engines' window between the version read and the request: 404."""
    engine.versions = ["1", "2"]
    engine.actions = [("status", 404, "The model `molt-lora-v1` does not exist.")]
    client = make_client(engine.url, adapter="molt-lora")
    gen = generate(client)
    assert [c.body["model"] for c in engine.generate_calls()] == ["molt-lora-v1", "molt-lora-v2"]
    assert gen.weight_versions == [2, 2, 2] and client.version_races == 1


def test_an_adapter_refused_every_time_fails_naming_it(engine):
    engine.actions = [("status", 404, "The model `molt-lora-v0` does not exist.")] * 10
    with pytest.raises(GenerationError, match="molt-lora-v0"):
        generate(make_client(engine.url, adapter="molt-lora"))
    assert len(engine.generate_calls()) == MAX_VERSION_RACES + 1


def test_without_adapters_a_404_fails_at_once(engine):
    engine.actions = [("status", 404, "The model `x` does not exist.")]
    with pytest.raises(GenerationError, match="does not exist"):
        generate(make_client(engine.url))
    assert len(engine.generate_calls()) == 1
