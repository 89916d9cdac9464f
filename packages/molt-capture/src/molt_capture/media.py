"""Images in a trace: their sources, the model's processor applied once (Idefics3 without image
splitting), and each processed image's record, which travels with the ids to engine and trainer."""

from __future__ import annotations

import base64
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
IMAGE_PARTS = ("image", "image_url")  # chat-template content parts that stand for an image


class MediaError(ValueError):
    """An image the data path cannot take (source, size, count, model): a 400 from the capture
    server, a dropped rollout in the Env runner."""


@dataclass
class ImageInput:
    """One image of a segment: the processor's tensors for it (Idefics3: `pixel_values`,
    `pixel_attention_mask`), the run of placeholder ids its embeddings replace, their digest."""

    offset: int
    length: int
    mm_hash: str
    tensors: dict[str, np.ndarray] = field(default_factory=dict)

    def shifted(self, by: int) -> ImageInput:
        return ImageInput(self.offset + by, self.length, self.mm_hash, self.tensors)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: each array as dtype, shape and base64 bytes."""
        arrays = {}
        for name, array in self.tensors.items():
            data = base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()
            arrays[name] = {"dtype": str(array.dtype), "shape": list(array.shape), "data": data}
        return {**vars(self), "tensors": arrays}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageInput:
        tensors = {}
        for name, a in d["tensors"].items():
            if isinstance(a, np.ndarray):  # asdict() of a live segment keeps the arrays
                tensors[name] = a
            else:
                flat = np.frombuffer(base64.b64decode(a["data"]), a["dtype"])
                tensors[name] = flat.reshape(a["shape"]).copy()
        return cls(d["offset"], d["length"], d["mm_hash"], tensors)


@dataclass
class ImagePrompt:
    """Token ids with every image placeholder expanded, and the images over them."""

    token_ids: list[int]
    images: list[ImageInput] = field(default_factory=list)


def tensor_hash(tensors: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}:{array.dtype}:{array.shape};".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def load_image(source: Any, where: str = "image"):
    """A PIL image from a PIL image, bytes, an HF `datasets.Image` dict, a data URL, a local file or
    bare base64; never a remote URL (rollouts must not depend on the network)."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return _checked(source, where)
    if isinstance(source, dict):
        if not (source.get("bytes") or source.get("path")):
            why = f"an image dict needs 'bytes' or 'path', got {sorted(source)}"
            raise MediaError(f"{where}: {why}")
        return load_image(source.get("bytes") or source["path"], where)
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
        why = "remote image URLs are not fetched; send a data URL or a local file"
        raise MediaError(f"{where}: {why}")
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
    except ValueError as e:  # binascii.Error included
        raise MediaError(f"{where}: not a file path, data URL or base64 image ({e})") from None


def _decode(data: bytes, where: str):
    from PIL import Image

    if len(data) > MAX_IMAGE_BYTES:
        raise MediaError(f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        image = Image.open(io.BytesIO(data))
        _checked(image, where)
        image.load()
    except (OSError, Image.DecompressionBombError) as e:  # UnidentifiedImageError included
        raise MediaError(f"{where}: not a decodable image ({e})") from None
    return image


def _checked(image, where: str):
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise MediaError(f"{where}: {width}x{height} is more than {MAX_IMAGE_PIXELS} pixels")
    return image


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
    """Rendered text and its images -> ids and pixels, from one processor call."""

    def __init__(self, processor, model_type: str, max_images: int = MAX_IMAGES):
        if model_type not in SUPPORTED_MODELS:
            why = f"images with a {model_type!r} model are not supported yet"
            raise MediaError(f"{why} (supported: {', '.join(SUPPORTED_MODELS)})")
        if getattr(processor.image_processor, "do_image_splitting", False):
            # Tiles interleave marker tokens between placeholder runs, which vLLM's token route
            # cannot take as one embedding range per image (it has no embedding mask).
            why = "Idefics3 image splitting is not supported; set do_image_splitting=False"
            raise MediaError(f"{why} in the processor")
        self.processor, self.max_images = processor, max_images
        self.image_token = processor.image_token
        self.image_token_id = processor.tokenizer.convert_tokens_to_ids(self.image_token)

    def encode(self, text: str, images: list, where: str = "images") -> ImagePrompt:
        """`images` in any `load_image` form, in the order their tokens appear in `text`."""
        tokens = text.count(self.image_token)
        if tokens != len(images):
            why = f"{len(images)} images for {tokens} {self.image_token} tokens"
            raise MediaError(f"{where}: {why} in the rendered prompt")
        if len(images) > self.max_images:
            raise MediaError(f"{where}: {len(images)} images, at most {self.max_images} per prompt")
        pil = [load_image(img, f"{where}[{i}]").convert("RGB") for i, img in enumerate(images)]
        out = self.processor(
            text=[text], images=[pil], return_tensors="np", add_special_tokens=False
        )
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


def message_images(messages: list[dict], pool: list | None = None, where: str = "prompt") -> list:
    """The image sources of chat messages, in order: each image part's own, else (a bare
    `{"type": "image"}`, as HF datasets write them) the next of `pool`, which must be used up."""
    pool = list(pool or [])
    sources, used = [], 0
    for m, message in enumerate(messages):
        content = message.get("content")
        for p, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, dict) or part.get("type") not in IMAGE_PARTS:
                continue
            inline = part.get("image") or part.get("url") or part.get("path")
            if part.get("type") == "image_url":
                url = part.get("image_url")
                inline = url.get("url") if isinstance(url, dict) else url
            if inline is None:
                if used == len(pool):
                    why = "is an image part without an image, and the row's 'images' are used up"
                    raise MediaError(f"{where}: message {m} part {p} {why}")
                inline, used = pool[used], used + 1
            sources.append(inline)
    if used != len(pool):
        why = f"the row has {len(pool)} images but its messages have {used} image parts"
        raise MediaError(f"{where}: {why} to place them")
    return sources


def openai_image_parts(messages: list[dict], pool: list | None = None) -> list[dict]:
    """The ChatAgent's prompt for an SDK: every image part (inline or from the row's `images`) as
    an OpenAI `image_url` part holding a PNG data URL (lossless, the processor's very pixels)."""
    sources = iter(message_images(messages, pool))

    def part(p: Any) -> Any:
        if not (isinstance(p, dict) and p.get("type") in IMAGE_PARTS):
            return p
        buffer = io.BytesIO()
        load_image(next(sources)).save(buffer, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        return {"type": "image_url", "image_url": {"url": url}}

    def content(parts: Any) -> Any:
        return [part(p) for p in parts] if isinstance(parts, list) else parts

    return [{**message, "content": content(message.get("content"))} for message in messages]


def placeholder_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of `token_id` in `ids`."""
    # Where the runs start and end, in turn: every change between `token_id` and another id.
    edges = np.flatnonzero(np.diff(np.asarray(ids) == token_id, prepend=False, append=False))
    return [(int(start), int(end - start)) for start, end in edges.reshape(-1, 2)]
