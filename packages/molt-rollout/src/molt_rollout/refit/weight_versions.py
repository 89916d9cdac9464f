"""Weight versions for vLLM 0.26 engines, which keep none: a middleware in the server serving
0.32's version API. A reply no refit overlapped is labelled with the version at its arrival;
one a refit overlapped (a `/pause` since) with the newest, so its first token disagrees with the
client's cache salt and the client sends it again. Standard library only."""

import json

from molt_rollout.refit.asgi import read_body, reply, reply_json

GENERATE_PATH = "/inference/v1/generate"


class WeightVersions:
    """Starlette/ASGI middleware: `app.add_middleware(WeightVersions)` (vLLM's --middleware)."""

    def __init__(self, app) -> None:
        self.app = app
        self.version = "default"  # what later vLLMs report before any update
        self.refits = 0  # /pause calls so far: a request compares it on arrival and on reply

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        if path == "/weight_info" and method == "GET":
            return await reply_json(send, 200, {"weight_version": self.version})
        if path == "/update_weight_version" and method == "POST":
            self.version = str(json.loads(await read_body(receive) or b"{}")["new_version"])
            return await reply_json(send, 200, {"weight_version": self.version})
        if path == "/pause":
            self.refits += 1
        if path == "/finish_weight_update" and method == "POST":
            body = await read_body(receive)
            start, answer = await _run(self.app, scope, _replay(body))
            version = json.loads(body or b"{}").get("weight_version")
            if start["status"] < 400 and version is not None:
                self.version = str(version)
            return await reply(send, start, answer)
        if path == GENERATE_PATH and method == "POST":
            version, refits = self.version, self.refits
            # the caller's receive: vLLM watches it for a disconnect
            start, body = await _run(self.app, scope, receive)
            if start["status"] == 200:
                body = _labelled(body, version if self.refits == refits else self.version)
            return await reply(send, start, body)
        return await self.app(scope, receive, send)


def _labelled(body: bytes, version: str) -> bytes:
    """The reply with one span per choice covering all its tokens."""
    reply = json.loads(body)
    for choice in reply.get("choices") or []:
        n = len(choice.get("token_ids") or [])
        choice["weight_versions"] = [{"start": 0, "end": n, "version": version}] if n else []
    return json.dumps(reply).encode()


def _replay(body: bytes):
    """A `receive` giving a body already read."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        return messages.pop() if messages else {"type": "http.disconnect"}

    return receive


async def _run(app, scope, receive) -> tuple[dict, bytes]:
    """The app's whole response: its start message and its body."""
    start, chunks = {}, []

    async def capture(message) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        else:
            chunks.append(message.get("body", b""))

    await app(scope, receive, capture)
    return start, b"".join(chunks)
