"""The token client: molt-capture's generator contract against vLLM's token-in/token-out API.

Token ids in; token ids, per-token log-probs (as sampled, post-temperature), finish reason,
per-token weight versions and routed experts out. Requests go through the router with the
rollout's session id, so a rollout stays on one engine. Every call has a timeout; transient
errors (connection failures, 5xx) are retried a bounded number of times with backoff; a 4xx
fails at once with the engine's own message.

Prefix cache and refits. Each request carries `cache_salt = molt-v<weight version>`, the
engine's version read just before sending, so a request never reuses prefix-cache blocks
computed under other weights, while requests kept in flight across a refit keep their own KV.
A refit can land between the version read and the prefill; the reply's first token then
reports a newer version than the salt, and the request is sent again with the new salt.

Adapter refit (`adapter`, molt_rollout.adapters): the engines serve each weight version as a
LoRA adapter of its own, and a request names the adapter of the version it read (`model`). It
then runs wholly under that version, whatever refits land meanwhile, so every token is
labelled with it; the engines' own version spans (the version they report as tokens are made)
do not apply. An adapter gone from the engines (a 404: it left their window between the
version read and the request) is asked for again with the current version.
"""

import asyncio
import base64
import io
import json
import re

import aiohttp
import numpy as np

from molt_capture.errors import ParamRejected
from molt_capture.media import ImageInput
from molt_capture.types import Generation, SamplingParams
from molt_rollout.network import Network

# The header vllm-router's sticky policy keys a rollout's requests on (molt_rollout.router).
# Here, not in router.py: a client (and so molt-train's config) imports no Ray.
SESSION_HEADER = "x-session-id"
FINAL_ONLY = 2  # vllm.sampling_params.RequestOutputKind.FINAL_ONLY (no vLLM import in runners)

GENERATE_PATH = "/inference/v1/generate"
MAX_VERSION_RACES = 2
INITIAL_VERSION = "default"  # what vLLM reports before any refit: Molt's version 0


class GenerationError(RuntimeError):
    """A generate call failed for good: a 4xx, a malformed reply, or retries exhausted."""


class EngineRefusal(GenerationError, ParamRejected):
    """The engine refused a sampling parameter (4xx naming it): the capture server answers
    the agent 400 naming the field, not a 5xx its SDK would retry."""

    def __init__(self, param: str, message: str):
        GenerationError.__init__(self, message)
        self.param, self.message = param, message


_SAMPLING_FIELDS = ("stop", "temperature", "top_p", "max_tokens")


def refused_param(text: str) -> str | None:
    """The sampling parameter a 4xx's body names: vLLM's `param`, else one in its message."""
    try:
        body = json.loads(text)
        error = body.get("error", body) if isinstance(body, dict) else {}
        param, message = error.get("param"), str(error.get("message", ""))
    except (ValueError, AttributeError):
        param, message = None, text
    if param in _SAMPLING_FIELDS:
        return param
    named = re.search(r"\b(" + "|".join(_SAMPLING_FIELDS) + r")\b", message)
    return named.group(1) if named else None


class UnknownModel(GenerationError):
    """The engine answered 404: it serves no model (adapter) of the name the request gave."""


def weight_version_number(version: str) -> int:
    return 0 if version == INITIAL_VERSION else int(version)


def adapter_name(prefix: str, version: int) -> str:
    """The LoRA adapter the engines serve weight version `version` as (adapter refit)."""
    return f"{prefix}-v{version}"


def parse_generation(
    reply: dict, prompt_len: int = 0, routing_start: int = 0, top_k: int = 0,
    version: int | None = None,
) -> Generation:  # fmt: skip
    """One vLLM generate reply -> Generation, checking every per-token list against the ids.
    `top_k` > 0: each token's k most likely candidates too (`top_candidates`). `version`: the
    weight version of every token (a request that named its version's adapter); None: the
    engine's version spans."""
    choice = reply["choices"][0]
    token_ids = list(choice["token_ids"])
    n = len(token_ids)
    entries = (choice.get("logprobs") or {}).get("content") or []
    if len(entries) != n:
        raise GenerationError(f"engine returned {n} tokens but {len(entries)} log-probs")
    versions: list[int] = [] if version is None else [version] * n
    for span in [] if version is not None else choice.get("weight_versions") or []:
        if span["start"] != len(versions):
            raise GenerationError(
                f"weight-version spans do not tile the output: {choice['weight_versions']}"
            )
        versions += [weight_version_number(span["version"])] * (span["end"] - span["start"])
    if len(versions) != n:
        raise GenerationError(
            f"engine returned {n} tokens but weight-version spans cover {len(versions)}"
        )
    return Generation(
        token_ids=token_ids,
        logprobs=[float(e["logprob"]) for e in entries],
        finish_reason=choice.get("finish_reason") or "stop",
        weight_versions=versions,
        routed_experts=parse_routed_experts(
            choice.get("routed_experts"), prompt_len, n, routing_start
        ),
        routing_start=routing_start,
        stop_reason=choice.get("stop_reason"),
        **top_candidates(entries, top_k),
    )


def top_candidates(entries: list[dict], k: int) -> dict:
    """The k most likely candidates of each position, as Generation's `top_ids` and
    `top_logprobs`. vLLM lists the sampled token first, then its top-k by rank, so the sampled
    token may appear twice or be one more than k: keep each id once and the k largest."""
    if k <= 0:
        return {}
    ids: list[list[int]] = []
    logprobs: list[list[float]] = []
    for entry in entries:
        best: dict[int, float] = {}
        for candidate in entry.get("top_logprobs") or []:
            best[int(candidate["token_id"])] = float(candidate["logprob"])
        if not best:
            raise GenerationError(f"asked for top-{k} log-probs, the engine returned none")
        head = sorted(best.items(), key=lambda item: -item[1])[:k]
        ids.append([token for token, _ in head])
        logprobs.append([value for _, value in head])
    return {"top_ids": ids, "top_logprobs": logprobs}


def parse_routed_experts(
    encoded: str | list | None, prompt_len: int, n: int, routing_start: int = 0
) -> list | None:
    """vLLM sends the experts each position was routed to as base64 `.npy` bytes, shape
    [positions, layers, top_k], for every position it ran from `routing_start` on: the rest of
    the prompt and every sampled token but the last (sampled, never run)."""
    if not encoded:
        return None
    if isinstance(encoded, list):  # already rows (e.g. a recorded reply)
        rows = encoded
    else:
        rows = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False).tolist()
    expected = prompt_len - routing_start + n - 1
    if len(rows) != expected:
        raise GenerationError(
            f"{len(rows)} routed-expert rows from position {routing_start} for {prompt_len} "
            f"prompt + {n} generated tokens (expected {expected})"
        )
    return rows


def check_placeholders(
    gen: Generation, token_ids: list[int], images: list[ImageInput]
) -> Generation:
    """Refuse a reply that sampled an image placeholder token: vLLM embeds it as text, but the
    trainer's VLM forward (transformers' Idefics3) takes every such id for an image slot and
    has no image for it. Only a near-random model samples one (the tiny VLM: about 0.3% per
    token); the rollout drops as `engine_error`."""
    if not images:  # a text prompt: nothing to check on the hot path
        return gen
    placeholders = {token_ids[image.offset] for image in images}
    if placeholders & set(gen.token_ids):
        raise GenerationError(f"the engine sampled an image placeholder token {placeholders}")
    return gen


def image_features(images: list[ImageInput]) -> dict:
    """The `features` of vLLM's token route for processed images: per image its tensors as
    vLLM's serialized MultiModalKwargsItem (laid out as vLLM's Idefics3 processor lays them:
    flat over the image's tiles, the tile count kept on CPU), its content hash (the prefix
    cache's key: two images never share cached blocks) and its placeholder run. The run holds
    the image tokens alone: the route takes no embedding mask, so each position in it is one."""
    import torch
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import encode_mm_kwargs_item
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItem

    items = []
    for image in images:
        tensors = {k: torch.from_numpy(v) for k, v in image.tensors.items()}
        tiles = torch.tensor([len(tensors["pixel_values"])])
        flat = MultiModalFieldConfig.flat_from_sizes("image", tiles)
        elems = {k: flat.build_elems(k, v)[0] for k, v in tensors.items()}
        elems["num_patches"] = MultiModalFieldConfig.batched("image", keep_on_cpu=True)\
            .build_elems("num_patches", tiles)[0]  # fmt: skip
        items.append(encode_mm_kwargs_item(MultiModalKwargsItem(elems)))
    return {
        "mm_hashes": {"image": [image.mm_hash for image in images]},
        "kwargs_data": {"image": items},
        "mm_placeholders": {
            "image": [{"offset": image.offset, "length": image.length} for image in images]
        },
    }


class TokenClient:
    """An async callable `(token_ids, SamplingParams, session_id) -> Generation`."""

    def __init__(self, base_url: str, model: str, timeout_s: float = 300.0, max_retries: int = 3,
                 backoff_s: float = 0.5, top_logprobs: int = 0,
                 adapter: str | None = None, token: str | None = None) -> None:  # fmt: skip
        """`top_logprobs` > 0: every reply carries each token's top-k candidates. `adapter`:
        the engines serve version v as the LoRA adapter `adapter_name(adapter, v)`, which each
        request names (adapter refit); None: the engines' own weights, named `model`. `token`:
        the run's token, sent on every request (engines on other nodes check it)."""
        self.top_logprobs, self.adapter = top_logprobs, adapter
        self.url = base_url.rstrip("/") + GENERATE_PATH
        self.version_url = base_url.rstrip("/") + "/weight_info"
        self.version_races = 0  # requests re-sent because a refit landed mid-request
        # The engines' weight version as the run's driver last told it (`tell_version`), or
        # None: read before every request. Told, a request needs no read (half the requests
        # an engine answers in a one-turn rollout); a told version is never ahead of the
        # engines, and one behind is caught by the race rule below, as a read one is.
        self.version: int | None = None
        self.model, self.max_retries, self.backoff_s = model, max_retries, backoff_s
        # aiohttp, not httpx: with a runner's hundreds of concurrent rollouts, httpx's pool
        # scans every connection per request (14 ms of CPU a rollout against 0.7 ms here;
        # docs/benchmarks.md, issue 13). No limit: one connection per rollout in flight.
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=timeout_s)
        self.auth = Network(token=token).headers()  # the run's token on every request
        self.http: aiohttp.ClientSession | None = None  # made in the caller's event loop

    async def __call__(
        self, token_ids: list[int], params: SamplingParams, session_id: str,
        images: list[ImageInput] = (),
    ) -> Generation:  # fmt: skip
        """`images`: the processed images whose placeholder runs `token_ids` hold; they go to
        the engine as `features`, so it runs no processor and keeps the ids as given."""
        headers = {SESSION_HEADER: session_id}
        body = {
            "model": self.model,
            "token_ids": list(token_ids),
            "sampling_params": {
                "max_tokens": params.max_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "stop": list(params.stop),
                "logprobs": self.top_logprobs,  # 0: the sampled token's own log-prob alone
                "flat_logprobs": True,  # arrays in the engine's output path, not a dict a token
                # No text: Molt reads ids. Stop strings need it (vLLM matches them on text).
                "detokenize": bool(params.stop),
                "skip_special_tokens": False,
                # One output at the end. The route's default (cumulative) builds an output and
                # wakes its handler for every request at every step: a quarter of the API
                # server's CPU under 1,024 requests on an H200 (docs/benchmarks.md).
                "output_kind": FINAL_ONLY,
                # Routed experts (when the engine returns them) only past what the caller has.
                "routed_experts_prompt_start": params.routing_start,
            },
        }
        if images:
            body["features"] = image_features(images)
        if self.adapter is not None:
            return check_placeholders(
                await self._from_adapter(token_ids, params, headers, body), token_ids, images
            )
        for _ in range(MAX_VERSION_RACES + 1):
            version = self.version if self.version is not None else await self._version(headers)
            body["cache_salt"] = f"molt-v{version}"
            reply = await self._request("POST", self.url, headers, body)
            generation = parse_generation(
                reply, len(token_ids), params.routing_start, self.top_logprobs
            )
            if not generation.weight_versions or generation.weight_versions[0] == version:
                return check_placeholders(generation, token_ids, images)
            self.version_races += 1
            if self.version is not None:  # a reply shows the engines' newer one: never ahead
                self.tell_version(generation.weight_versions[0])
        # Refits keep landing between the version read and the prefill (a busy engine): keep
        # the last answer rather than drop the rollout. Its tokens carry the versions that
        # produced them; only its prompt's cache salt was a version behind, as for a request
        # kept in flight across a refit.
        return check_placeholders(generation, token_ids, images)

    async def _from_adapter(
        self, token_ids: list[int], params: SamplingParams, headers: dict, body: dict
    ) -> Generation:
        """Adapter refit: the request names the adapter of the version it read, so all its
        tokens are that version's."""
        for _ in range(MAX_VERSION_RACES + 1):
            version = await self._version(headers)
            body.update(model=adapter_name(self.adapter, version), cache_salt=f"molt-v{version}")
            try:
                reply = await self._request("POST", self.url, headers, body)
            except UnknownModel:  # the adapter left the engines' window: read the version again
                self.version_races += 1
                continue
            return parse_generation(reply, len(token_ids), params.routing_start,
                                    self.top_logprobs, version)  # fmt: skip
        raise GenerationError(f"the engines refused the adapter of the version they reported "
                              f"({body['model']}) {MAX_VERSION_RACES + 1} times")  # fmt: skip

    def tell_version(self, version: int) -> None:
        """From the run's driver, once every engine serves `version`: from now on no read per
        request (the adapter refit keeps its reads: its request names the version's adapter,
        which must still be loaded)."""
        if self.adapter is None:
            self.version = version if self.version is None else max(self.version, version)

    async def _version(self, headers: dict) -> int:
        reply = await self._request("GET", self.version_url, headers)
        return weight_version_number(reply["weight_version"])

    async def _request(
        self, method: str, url: str, headers: dict, body: dict | None = None
    ) -> dict:
        if self.http is None:
            self.http = aiohttp.ClientSession(timeout=self.timeout, headers=self.auth,
                                              connector=aiohttp.TCPConnector(limit=0))  # fmt: skip
        for attempt in range(self.max_retries + 1):
            try:
                async with self.http.request(method, url, json=body, headers=headers) as response:
                    status, text = response.status, await response.text()
            except aiohttp.SocketTimeoutError as error:  # no reply in time: the engine is stuck
                raise GenerationError(f"{url} timed out ({error!r})") from error
            except aiohttp.ClientError as error:  # refused, dropped, or a connect timeout
                failure = f"connection error {error!r}"
            else:
                if status < 400:
                    try:
                        return json.loads(text)
                    except ValueError as error:
                        raise GenerationError(f"{url} answered non-JSON: {text[:200]}") from error
                if status < 500:
                    message = f"engine refused the request ({status}): {text}"
                    if status == 404:
                        raise UnknownModel(message)
                    param = refused_param(text)
                    raise EngineRefusal(param, message) if param else GenerationError(message)
                failure = f"engine error {status}: {text[:500]}"
            if attempt < self.max_retries:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise GenerationError(f"{url} failed after {self.max_retries + 1} attempts: {failure}")

    async def aclose(self) -> None:
        if self.http is not None:
            await self.http.close()
            self.http = None
