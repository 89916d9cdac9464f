"""The token check of an engine reachable from other nodes, a vLLM server middleware: vLLM's
`--api-key` guards not the RL control routes dev mode mounts (`/pause`, `/update_weights`, ...);
this asks for the token on every path but `/health`, the probes'."""

import hmac
import os

from molt_rollout.refit.asgi import reply_json

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
