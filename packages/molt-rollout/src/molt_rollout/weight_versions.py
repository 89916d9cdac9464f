"""Weight versions for vLLM 0.26 engines, which keep none: an ASGI middleware in the server.

Later vLLMs report the weight version (`GET /weight_info`, `POST /update_weight_version`,
`finish_weight_update`'s `weight_version`) and label every generated token with the version
that produced it (`weight_versions` spans). Molt's token client and refitter rely on both. On
0.26, vllm_compat starts the server with `--middleware` naming the class below, which serves
the same API from the server process, where it sees every refit pass through `/pause`:

- a generate request that no refit overlapped (no `/pause` since it arrived) is labelled, whole,
  with the version current at its arrival: exact;
- one that a refit overlapped is labelled with the newest version. Its first token then differs
  from the version the client salted the request with, so the client sends it again (its
  existing race rule, client.py): a kept request is regenerated rather than mislabelled. The
  cost is the work in flight at each refit (`TokenClient.version_races` counts the re-sends).

Standard library only: it runs inside the vLLM server process.
"""

import json

from molt_rollout.asgi import read_body, reply_json

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
            headers = [
                (k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"
            ]
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
    sent = False
    status = {"code": 500}

    async def replay():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def watch(message) -> None:
        if message["type"] == "http.response.start":
            status["code"] = message["status"]
        await send(message)

    await app(scope, replay, watch)
    return status["code"]
