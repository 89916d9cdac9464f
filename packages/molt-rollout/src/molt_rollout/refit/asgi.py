"""What Molt's middlewares in the vLLM server share. Standard library only: they run there."""

import json


async def reply_json(send, status: int, payload: dict) -> None:
    headers = [(b"content-type", b"application/json")]
    start = {"type": "http.response.start", "status": status, "headers": headers}
    await reply(send, start, json.dumps(payload).encode())


async def reply(send, start: dict, body: bytes) -> None:
    """A response: `start` (its content-length set to the body's), then the body."""
    headers = [h for h in start.get("headers", []) if h[0].lower() != b"content-length"]
    await send({**start, "headers": [*headers, (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


async def read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)
