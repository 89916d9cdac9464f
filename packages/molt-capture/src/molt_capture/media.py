"""Images in a trace: where they come from, the model's processor applied once, and the typed
record of one processed image that travels with the token ids from the runner to the trainer.

`ImageEncoder` renders chat text that holds one image token per image (as the chat template
writes it) into the token ids with every placeholder expanded, plus one `ImageInput` per image:
the processor's tensors for it, the position of its placeholder run in the ids, and a content
hash. The engine gets those tensors and hashes (vLLM's token route, no re-processing: the
hashes key its prefix cache, so two images never share cached blocks), and the trainer feeds
the same tensors to the policy forward with the same ids.

Supported layout: Idefics3 without image splitting (one tile and one placeholder run per image;
molt_rollout.tiny_vlm). Anything else is refused at construction, not silently mis-laid.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MAX_IMAGE_BYTES = 8 * 1024 * 1024  # an encoded image larger than this is refused
MAX_IMAGE_PIXELS = 4096 * 4096  # decoded width x height; also guards against decompression bombs
MAX_IMAGES = 8  # per prompt (segment); the engine's --limit-mm-per-prompt must allow as many
SUPPORTED_MODELS = ("idefics3",)
IMAGES_REFUSED = (
    "image, audio and file input needs a multimodal model; this server serves a text-only model"
)


class MediaError(ValueError):
    """An image the data path cannot take: its source, size, count or the model. The capture
    server answers it as a 400; the Env runner drops the rollout as `bad_row`/`bad_result`."""


@dataclass
class ImageInput:
    """One image of a segment as the model's processor made it.

    `tensors` are the processor's per-image outputs (Idefics3: `pixel_values` [tiles, 3, H, W]
    and `pixel_attention_mask` [tiles, H, W]); `offset`/`length` the run of placeholder tokens in
    the segment's ids that the image's embeddings replace; `mm_hash` a digest of the tensors."""

    offset: int
    length: int
    mm_hash: str
    tensors: dict[str, np.ndarray] = field(default_factory=dict)

    def shifted(self, by: int) -> ImageInput:
        return ImageInput(self.offset + by, self.length, self.mm_hash, self.tensors)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: each array as dtype, shape and base64 bytes."""
        arrays = {
            k: {"dtype": str(a.dtype), "shape": list(a.shape),
                "data": base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()}
            for k, a in self.tensors.items()
        }  # fmt: skip
        return {"offset": self.offset, "length": self.length, "mm_hash": self.mm_hash,
                "tensors": arrays}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageInput:
        tensors = {}
        for k, a in d["tensors"].items():
            if isinstance(a, np.ndarray):  # asdict() of a live segment keeps the arrays
                tensors[k] = a
                continue
            flat = np.frombuffer(base64.b64decode(a["data"]), dtype=a["dtype"])
            tensors[k] = flat.reshape(a["shape"]).copy()
        return cls(d["offset"], d["length"], d["mm_hash"], tensors)


@dataclass
class ImagePrompt:
    """Token ids with every image placeholder expanded, and the images over them (offsets into
    `token_ids`): what one processor call makes of rendered text and its images."""

    token_ids: list[int]
    images: list[ImageInput] = field(default_factory=list)


def tensor_hash(tensors: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}:{array.dtype}:{array.shape};".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


# ---- image sources --------------------------------------------------------------------------


def load_image(source: Any, where: str = "image"):
    """A PIL image (RGB) from any form a dataset row or a client may hold: a PIL image, bytes,
    `{"bytes": ..., "path": ...}` (an HF `datasets.Image` value), a `data:image/...;base64,`
    URL, a `file://` URL or local path, or bare base64. Remote URLs are refused: rollouts must
    not depend on the network. Raises MediaError naming `where`."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return _checked(source, where)
    if isinstance(source, dict):
        if source.get("bytes"):
            return load_image(source["bytes"], where)
        if source.get("path"):
            return load_image(source["path"], where)
        raise MediaError(f"{where}: an image dict needs 'bytes' or 'path', got {sorted(source)}")
    if isinstance(source, bytes | bytearray):
        return _decode(bytes(source), where)
    if not isinstance(source, str):
        raise MediaError(f"{where}: unsupported image type {type(source).__name__}")
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if not header.startswith("data:image/") or not header.endswith(";base64"):
            raise MediaError(f"{where}: a data URL must be data:image/<type>;base64,...")
        return _decode(_b64(payload, where), where)
    if source.startswith(("http://", "https://")):
        raise MediaError(f"{where}: remote image URLs are not fetched; send a data URL or a "
                         "local file")  # fmt: skip
    path = Path(source.removeprefix("file://"))
    if source.startswith("file://") or (len(source) < 4096 and path.suffix and path.exists()):
        if not path.is_file():
            raise MediaError(f"{where}: image file {path} does not exist")
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise MediaError(f"{where}: {path} is larger than {MAX_IMAGE_BYTES} bytes")
        return _decode(path.read_bytes(), where)
    return _decode(_b64(source, where), where)


def _b64(payload: str, where: str) -> bytes:
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise MediaError(f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"{where}: not a file path, data URL or base64 image ({e})") from None


def _decode(data: bytes, where: str):
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise MediaError(f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        image = Image.open(io.BytesIO(data))
        _checked(image, where)
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise MediaError(f"{where}: not a decodable image ({e})") from None
    return image


def _checked(image, where: str):
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise MediaError(f"{where}: {width}x{height} is more than {MAX_IMAGE_PIXELS} pixels")
    return image


# ---- the processor, applied once ------------------------------------------------------------


def load_image_encoder(model_path: str, max_images: int = MAX_IMAGES) -> ImageEncoder | None:
    """The model's image encoder, or None for a text-only model (no image processor)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    if getattr(config, "vision_config", None) is None:
        return None
    # Only now: its import costs a text-only runner about 1 s of CPU at start-up.
    from transformers import AutoProcessor

    return ImageEncoder(AutoProcessor.from_pretrained(model_path), config.model_type, max_images)


class ImageEncoder:
    """Chat text with one image token per image, plus the images -> expanded ids and one
    ImageInput per image. The text is the chat template's render (the same renderer the text
    path uses); only the processor expands placeholders, so ids and pixels come from one call."""

    def __init__(self, processor, model_type: str, max_images: int = MAX_IMAGES):
        if model_type not in SUPPORTED_MODELS:
            raise MediaError(f"images with a {model_type!r} model are not supported yet "
                             f"(supported: {', '.join(SUPPORTED_MODELS)})")  # fmt: skip
        if getattr(processor.image_processor, "do_image_splitting", False):
            # Tiles interleave marker tokens between placeholder runs, which vLLM's token route
            # cannot take as one embedding range per image (it has no embedding mask).
            raise MediaError("Idefics3 image splitting is not supported; set "
                             "do_image_splitting=False in the processor")  # fmt: skip
        self.processor, self.max_images = processor, max_images
        self.image_token = processor.image_token
        self.image_token_id = processor.tokenizer.convert_tokens_to_ids(self.image_token)

    def count(self, text: str) -> int:
        return text.count(self.image_token)

    def encode(self, text: str, images: list, where: str = "images") -> ImagePrompt:
        """`images` in any `load_image` form, in the order their tokens appear in `text`."""
        if self.count(text) != len(images):
            raise MediaError(f"{where}: {len(images)} images for {self.count(text)} "
                             f"{self.image_token} tokens in the rendered prompt")  # fmt: skip
        if len(images) > self.max_images:
            raise MediaError(f"{where}: {len(images)} images, at most {self.max_images} per "
                             "prompt")  # fmt: skip
        if not images:
            return ImagePrompt(self.processor.tokenizer.encode(text, add_special_tokens=False))
        pil = [load_image(img, f"{where}[{i}]").convert("RGB") for i, img in enumerate(images)]
        out = self.processor(text=[text], images=[pil], return_tensors="np",
                             add_special_tokens=False)  # fmt: skip
        ids = [int(t) for t in out["input_ids"][0]]
        runs = placeholder_runs(ids, self.image_token_id)
        if len(runs) != len(images):
            raise MediaError(f"{where}: {len(runs)} placeholder runs for {len(images)} images")
        per_image = {k: v[0] for k, v in out.items() if k not in ("input_ids", "attention_mask")}
        tiles = len(per_image["pixel_values"]) // len(images)
        inputs = []
        for i, (offset, length) in enumerate(runs):
            tensors = {k: v[i * tiles : (i + 1) * tiles] for k, v in per_image.items()}
            inputs.append(ImageInput(offset, length, tensor_hash(tensors), tensors))
        return ImagePrompt(ids, inputs)


IMAGE_PARTS = ("image", "image_url")  # chat-template content parts that stand for an image


def message_images(messages: list[dict], pool: list | None = None, where: str = "prompt") -> list:
    """The image sources of chat messages, in order: each image part's own (`{"type": "image",
    "image": src}`, `{"type": "image_url", "image_url": {"url": src}}`), else the next of `pool`
    (a dataset row's `images` column, for bare `{"type": "image"}` parts as HF datasets write
    them). Every pool image must be used."""
    pool = list(pool or [])
    sources, used = [], 0
    for m, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in IMAGE_PARTS:
                continue
            inline = part.get("image") or part.get("url") or part.get("path")
            if part.get("type") == "image_url":
                url = part.get("image_url")
                inline = url.get("url") if isinstance(url, dict) else url
            if inline is None:
                if used == len(pool):
                    raise MediaError(f"{where}: message {m} part {p} is an image part without "
                                     "an image, and the row's 'images' are used up")  # fmt: skip
                inline, used = pool[used], used + 1
            sources.append(inline)
    if used != len(pool):
        raise MediaError(f"{where}: the row has {len(pool)} images but its messages have "
                         f"{used} image parts to place them")  # fmt: skip
    return sources


def data_url(source: Any, where: str = "image") -> str:
    """An image in any `load_image` form as a PNG data URL (lossless: the pixels the processor
    sees are the source's)."""
    buffer = io.BytesIO()
    load_image(source, where).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def openai_image_parts(messages: list[dict], pool: list | None = None) -> list[dict]:
    """Chat messages with every image part (inline or from the row's `images`) as an OpenAI
    `image_url` part holding a data URL: the ChatAgent's prompt, ready for an SDK."""
    sources = iter(message_images(messages, pool))
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [
                {"type": "image_url", "image_url": {"url": data_url(next(sources))}}
                if isinstance(part, dict) and part.get("type") in IMAGE_PARTS
                else part
                for part in content
            ]
        out.append({**message, "content": content})
    return out


def placeholder_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of `token_id` in `ids`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
