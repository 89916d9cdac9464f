"""`POST /pause` without vLLM's fixed 20 ms wait, plus `keep_kv=true`: a middleware in the
engine's server. The wait lets outputs on their way reach callers, not needed where every
output is labelled with its version; keep_kv skips vLLM's cache reset, which preempts every
running request, since requests salt the prefix cache with the version. Standard library only."""

from urllib.parse import parse_qs

from molt_rollout.refit.asgi import reply_json

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
        # a multimodal model's encoder cache is shared unsalted; unknown counts as multimodal
        multimodal = getattr(getattr(engine, "model_config", None), "is_multimodal_model", True)
        if _true(query.get("keep_kv", "false")) and not multimodal:
            clear_cache = False
        if mode not in MODES:
            return await reply_json(send, 400, {"error": f"mode must be one of {MODES}: {mode!r}"})
        try:
            if clear_cache:
                await engine.renderer.clear_mm_cache_async()
            await core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)
        except ValueError as error:
            return await reply_json(send, 400, {"error": str(error)})
        except Exception as error:  # as vLLM's route: the reply says why
            return await reply_json(send, 500, {"error": f"Failed to pause generation: {error}"})
        await reply_json(send, 200, {"status": "paused"})


def _true(value: str) -> bool:
    return value.lower() in ("1", "true", "yes", "on")
