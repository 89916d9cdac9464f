"""Molt's /pause (fast_pause.py): its reading of vLLM's query fields, on a stand-in engine
client. The real engine answers through it in tests_integration/test_engines.py (CPU) and in
every refit test, and on a GPU in tests_integration/gpu."""

import asyncio
from types import SimpleNamespace

import httpx
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from molt_rollout.refit.fast_pause import Pause


def stand_in(engine_client) -> Starlette:
    """A server whose own /pause (vLLM's route) answers "vllm", with `engine_client` on its
    state and Molt's middleware added, as vLLM does both."""

    async def vllm_pause(request):
        return JSONResponse({"status": "vllm"})

    app = Starlette(routes=[Route("/pause", vllm_pause, methods=["POST"])])
    app.state.engine_client = engine_client
    app.add_middleware(Pause)
    return app


def engine_client(calls: list, multimodal: bool | None = None):
    async def pause_scheduler_async(mode, clear_cache):
        calls.append(("pause", mode, clear_cache))

    async def clear_mm_cache_async():
        calls.append(("clear_mm_cache",))

    client = SimpleNamespace(
        engine_core=SimpleNamespace(pause_scheduler_async=pause_scheduler_async),
        renderer=SimpleNamespace(clear_mm_cache_async=clear_mm_cache_async),
    )
    if multimodal is not None:
        client.model_config = SimpleNamespace(is_multimodal_model=multimodal)
    return client


def post(app, query: str) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
            return await http.post("/pause" + query)

    return asyncio.run(run())


def test_pause_reads_vllms_fields_and_defaults():
    calls = []
    app = stand_in(engine_client(calls))
    assert post(app, "").json() == {"status": "paused"}
    assert calls == [("clear_mm_cache",), ("pause", "abort", True)]  # vLLM's defaults
    calls.clear()
    assert post(app, "?mode=keep&clear_cache=false").status_code == 200
    assert calls == [("pause", "keep", False)]
    calls.clear()
    assert post(app, "?wait_for_inflight_requests=true&clear_cache=false").status_code == 200
    assert calls == [("pause", "wait", False)]  # 0.26's deprecated field still means "wait"
    calls.clear()
    bad = post(app, "?mode=later")
    assert bad.status_code == 400 and "mode must be one of" in bad.json()["error"]
    assert calls == []


def test_keep_kv_keeps_a_text_models_cache_only():
    for multimodal, cleared in ((False, False), (True, True), (None, True)):  # None: unknown
        calls = []
        assert post(
            stand_in(engine_client(calls, multimodal)), "?mode=keep&keep_kv=true"
        ).json() == {"status": "paused"}
        assert calls[-1] == ("pause", "keep", cleared), multimodal
        assert (("clear_mm_cache",) in calls) == cleared


def test_an_engine_client_without_the_calls_leaves_pause_to_vllm():
    assert post(stand_in(SimpleNamespace()), "?mode=keep").json() == {"status": "vllm"}
