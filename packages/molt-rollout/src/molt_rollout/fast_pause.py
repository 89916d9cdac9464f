"""`POST /pause` without vLLM's fixed 20 ms wait: an ASGI middleware in the engine's server.

vLLM's `/pause` route calls `AsyncLLM.pause_generation`, which asks the engine core to pause
and then sleeps 20 ms so that outputs already on their way reach their callers first; vLLM
says the sleep is "not required for correctness" (0.26 and 0.32 alike). Molt does not need it
either: a request a refit overlaps is labelled by the version it was produced with, whenever
its reply arrives. On one H200 the sleep was 20 of the 25 ms pause, and a quarter of a 4 GB
refit (docs/benchmarks.md). This middleware answers `/pause` with the same two engine calls
and the same replies, minus the sleep; where the engine client lacks them (another vLLM), it
leaves the call to vLLM's route. Added to every Molt engine with `--middleware` (config.py).

`keep_kv=true`, Molt's own field (the refitter sends it), keeps the KV cache through the pause.
vLLM's cache reset preempts every running request, so a request kept across a refit would
lose its KV and prefill again. Nothing needs the reset: Molt's requests salt the prefix cache
with the weight version (client.py), so none reuses blocks of older weights. A multimodal
model is the exception: its encoder outputs depend on the weights and vLLM shares them between
requests by image hash, unsalted, and drops them safely only with the rest, so for such a model
`keep_kv` changes nothing. vLLM's own route ignores the field and resets (the safe side).

Standard library only: it runs inside the vLLM server process.
"""

from urllib.parse import parse_qs

from molt_rollout.asgi import reply_json

MODES = ("abort", "wait", "keep")


class Pause:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/pause" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        engine = getattr(scope["app"].state, "engine_client", None)
        core = getattr(engine, "engine_core", None)
        if not hasattr(core, "pause_scheduler_async") or not hasattr(engine, "renderer"):
            return await self.app(scope, receive, send)
        query = {k: v[-1] for k, v in parse_qs(scope["query_string"].decode()).items()}
        mode = "wait" if _true(query.get("wait_for_inflight_requests", "false")) else None
        mode = mode or query.get("mode", "abort")  # vLLM's defaults
        clear_cache = _true(query.get("clear_cache", "true"))
        if _true(query.get("keep_kv", "false")) and not _multimodal(engine):
            clear_cache = False
        if mode not in MODES:
            return await reply_json(
                send, 400, {"error": f"mode must be one of {MODES}, got {mode!r}"}
            )
        try:
            if clear_cache:
                await engine.renderer.clear_mm_cache_async()
            await core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)
        except ValueError as error:
            return await reply_json(send, 400, {"error": str(error)})
        except Exception as error:  # as vLLM's route: the reply says why
            return await reply_json(send, 500, {"error": f"Failed to pause generation: {error}"})
        await reply_json(send, 200, {"status": "paused"})


def _multimodal(engine) -> bool:
    """Whether the engine serves a multimodal model; unknown counts as one (clears all)."""
    return getattr(getattr(engine, "model_config", None), "is_multimodal_model", True)


def _true(value: str) -> bool:
    return value.lower() in ("1", "true", "yes", "on")
