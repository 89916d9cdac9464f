"""The token check of an engine reachable from other nodes, loaded into its vLLM server with
`--middleware molt_rollout.engine_auth.RequireToken` (molt_rollout.network).

vLLM's own `--api-key` (VLLM_API_KEY, which the engine also gets) guards only its `/v1`, `/v2`
and `/inference` routes; the RL control routes that dev mode mounts (`/pause`,
`/init_weight_transfer_engine`, `/update_weights`, ...) would stay open. This middleware asks
for the token on every path but `/health`, which the readiness and liveness probes use. Plain
ASGI: vLLM adds a class with `app.add_middleware`.
"""

import hmac
import os

from molt_rollout.asgi import reply_json

TOKEN_ENV = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})


class RequireToken:
    def __init__(self, app) -> None:
        self.app = app
        self.expected = f"Bearer {os.environ[TOKEN_ENV]}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        await reply_json(send, 401, {"error": "missing or wrong token"})
