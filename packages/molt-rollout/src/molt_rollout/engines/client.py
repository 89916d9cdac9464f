"""The token client: molt-capture's generator contract against vLLM's token-in/token-out API,
through the router, sticky on the rollout's session. A request salts the prefix cache with the
weight version it read, and is sent again when a refit lands before its prefill."""

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
from molt_rollout.config import adapter_name
from molt_rollout.network import Network
from molt_rollout.refit.weight_versions import GENERATE_PATH

# The header vllm-router's sticky policy keys a rollout's requests on (here: a client imports
# no Ray).
SESSION_HEADER = "x-session-id"
FINAL_ONLY = 2  # vllm.sampling_params.RequestOutputKind.FINAL_ONLY (no vLLM import in runners)

MAX_VERSION_RACES = 2
INITIAL_VERSION = "default"  # what vLLM reports before any refit: Molt's version 0


class GenerationError(RuntimeError):
    """A generate call failed for good: a 4xx, a malformed reply, or retries exhausted."""


class EngineRefusal(ParamRejected, GenerationError):
    """The engine refused a sampling parameter: the agent gets a 400 naming it, not a 5xx."""


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


def parse_generation(
    reply: dict, prompt_len: int = 0, routing_start: int = 0, top_k: int = 0, version=None
) -> Generation:
    """One vLLM generate reply -> Generation, each per-token list checked against the ids.
    `top_k`: candidates per token too; `version`: every token's (else the engine's spans)."""
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
    """Each position's k most likely candidates (`top_ids`, `top_logprobs`). vLLM lists the
    sampled token first, then the top-k, so it may come twice or make k + 1: keep the k best."""
    if k <= 0:
        return {}
    ids, logprobs = [], []
    for entry in entries:
        best = {int(c["token_id"]): float(c["logprob"]) for c in entry.get("top_logprobs") or []}
        if not best:
            raise GenerationError(f"asked for top-{k} log-probs, the engine returned none")
        head = sorted(best.items(), key=lambda item: -item[1])[:k]
        ids.append([token for token, _ in head])
        logprobs.append([value for _, value in head])
    return {"top_ids": ids, "top_logprobs": logprobs}


def parse_routed_experts(
    encoded: str | list | None, prompt_len: int, n: int, routing_start: int = 0
) -> list | None:
    """The experts of each position vLLM ran from `routing_start` on (all but the last sampled
    token), sent as base64 `.npy` of [positions, layers, top_k]."""
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
    """Refuse a reply that sampled an image placeholder token (only a near-random model does):
    the trainer's VLM forward would take it for an image slot with no image."""
    if not images:  # a text prompt: nothing to check on the hot path
        return gen
    placeholders = {token_ids[image.offset] for image in images}
    if placeholders & set(gen.token_ids):
        raise GenerationError(f"the engine sampled an image placeholder token {placeholders}")
    return gen


def image_features(images: list[ImageInput]) -> dict:
    """The `features` of vLLM's token route for processed images: per image its tensors (as
    vLLM's Idefics3 processor lays them out), content hash and placeholder run."""
    import torch
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import encode_mm_kwargs_item
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItem

    items = []
    for image in images:
        tensors = {k: torch.from_numpy(v) for k, v in image.tensors.items()}
        tiles = torch.tensor([len(tensors["pixel_values"])])
        flat = MultiModalFieldConfig.flat_from_sizes("image", tiles)
        elems = {k: flat.build_elems(k, v)[0] for k, v in tensors.items()}
        batched = MultiModalFieldConfig.batched("image", keep_on_cpu=True)
        elems["num_patches"] = batched.build_elems("num_patches", tiles)[0]
        items.append(encode_mm_kwargs_item(MultiModalKwargsItem(elems)))
    placeholders = [{"offset": image.offset, "length": image.length} for image in images]
    return {
        "mm_hashes": {"image": [image.mm_hash for image in images]},
        "kwargs_data": {"image": items},
        "mm_placeholders": {"image": placeholders},
    }


class TokenClient:
    """An async callable `(token_ids, SamplingParams, session_id) -> Generation`."""

    def __init__(
        self,
        base_url: str,
        model: str,
        timeout_s: float = 300.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        top_logprobs: int = 0,
        adapter: str | None = None,
        token: str | None = None,
    ) -> None:
        """`top_logprobs`: candidates per token; `adapter`: the adapter refit's name prefix (a
        request names its version's adapter, else `model`); `token`: the run's."""
        self.top_logprobs, self.adapter = top_logprobs, adapter
        self.url = base_url.rstrip("/") + GENERATE_PATH
        self.version_url = base_url.rstrip("/") + "/weight_info"
        self.version_races = 0  # requests re-sent because a refit landed mid-request
        # The engines' version as the driver last told it, or None: read before each request.
        # A told version is never ahead of the engines; one behind is a race, as a read one.
        self.version: int | None = None
        self.model, self.max_retries, self.backoff_s = model, max_retries, backoff_s
        # aiohttp, not httpx: with a runner's hundreds of concurrent rollouts, httpx's pool
        # scans every connection per request (docs/performance.md). No limit: one connection
        # per rollout in flight.
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=timeout_s)
        self.auth = Network(token=token).headers()  # the run's token on every request
        self.http: aiohttp.ClientSession | None = None  # made in the caller's event loop

    async def __call__(
        self, token_ids: list[int], params: SamplingParams, session_id: str, images=()
    ) -> Generation:
        """`images`: processed images whose placeholder runs `token_ids` hold, sent as features
        (the engine runs no processor and keeps the ids as given)."""
        headers, body = {SESSION_HEADER: session_id}, self._body(token_ids, params, images)
        for _ in range(MAX_VERSION_RACES + 1):
            version = self.version if self.version is not None else await self._version(headers)
            body["cache_salt"] = f"molt-v{version}"
            if self.adapter is not None:  # all its tokens are this version's
                body["model"] = adapter_name(self.adapter, version)
            try:
                reply = await self._request("POST", self.url, headers, body)
            except UnknownModel:
                if self.adapter is None:
                    raise
                self.version_races += 1  # the adapter left the engines' window: read again
                continue
            labels = version if self.adapter is not None else None
            generation = parse_generation(
                reply, len(token_ids), params.routing_start, self.top_logprobs, labels
            )
            first = generation.weight_versions[:1]
            if self.adapter is not None or first in ([], [version]):
                return check_placeholders(generation, token_ids, images)
            self.version_races += 1
            if self.version is not None:  # a reply shows the engines' newer one: never ahead
                self.tell_version(first[0])
        if self.adapter is not None:
            raise GenerationError(
                f"the engines refused the adapter of the version they reported ({body['model']}) "
                f"{MAX_VERSION_RACES + 1} times"
            )
        # Refits keep landing between the version read and the prefill (a busy engine): keep
        # the last answer, whose tokens carry the versions that made them; only its prompt's
        # cache salt was a version behind, as for a request kept in flight across a refit.
        return check_placeholders(generation, token_ids, images)

    def tell_version(self, version: int) -> None:
        """From the driver, once every engine serves `version`: no read per request from now
        on (but with adapters, whose request names one that must still be loaded)."""
        if self.adapter is None:
            self.version = version if self.version is None else max(self.version, version)

    def _body(self, token_ids: list[int], params: SamplingParams, images) -> dict:
        """The generate request, less what each attempt sets (the version's salt, adapter)."""
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
                # server's CPU under a thousand requests (docs/performance.md).
                "output_kind": FINAL_ONLY,
                # Routed experts (when the engine returns them) only past what the caller has.
                "routed_experts_prompt_start": params.routing_start,
            },
        }
        if params.seed is not None:
            body["sampling_params"]["seed"] = params.seed
        if images:
            body["features"] = image_features(images)
        return body

    async def _version(self, headers: dict) -> int:
        reply = await self._request("GET", self.version_url, headers)
        return weight_version_number(reply["weight_version"])

    async def _request(
        self, method: str, url: str, headers: dict, body: dict | None = None
    ) -> dict:
        if self.http is None:
            connection = {"connector": aiohttp.TCPConnector(limit=0), "headers": self.auth}
            self.http = aiohttp.ClientSession(timeout=self.timeout, **connection)
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
