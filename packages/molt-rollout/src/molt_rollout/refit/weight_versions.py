"""Weight versions for vLLM 0.26 engines, which keep none: a middleware in the server serving
0.32's version API. A reply no refit overlapped is labelled with the version at its arrival;
one a refit overlapped (a `/pause` since) with the newest, so its first token disagrees with the
client's cache salt and the client sends it again. Standard library only."""

import json

from molt_rollout.refit.asgi import read_body, reply_json

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
            body = await read_body(receive)
            self.version = str(json.loads(body or b"{}")["new_version"])
            return await reply_json(send, 200, {"weight_version": self.version})
        if path == "/pause":
            self.refits += 1
        if path == "/finish_weight_update" and method == "POST":
            body = await read_body(receive)
            version = json.loads(body or b"{}").get("weight_version")
            status = await _forward(self.app, scope, body, send)
            if status < 400 and version is not None:
                self.version = str(version)
            return None
        if path == GENERATE_PATH and method == "POST":
            return await self._generate(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _generate(self, scope, receive, send) -> None:
        version, refits = self.version, self.refits
        start: dict = {}
        chunks: list[bytes] = []

        async def capture(message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = b"".join(chunks)
            if start["status"] == 200:
                label = version if self.refits == refits else self.version
                body = _labelled(body, label)
            headers = [h for h in start.get("headers", []) if h[0].lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, capture)


def _labelled(body: bytes, version: str) -> bytes:
    """The reply with one span per choice covering all its tokens."""
    reply = json.loads(body)
    for choice in reply.get("choices") or []:
        n = len(choice.get("token_ids") or [])
        choice["weight_versions"] = [{"start": 0, "end": n, "version": version}] if n else []
    return json.dumps(reply).encode()


async def _forward(app, scope, body: bytes, send) -> int:
    """Run the app on a body already read; returns the response status."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    status = [500]

    async def replay():
        return messages.pop() if messages else {"type": "http.disconnect"}

    async def watch(message) -> None:
        if message["type"] == "http.response.start":
            status[0] = message["status"]
        await send(message)

    await app(scope, replay, watch)
    return status[0]
