"""Image sources, their limits and the typed image record (no processor: the tiny VLM's is
exercised in molt-rollout's test_vlm_data.py)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

import molt_capture.media as media
from molt_capture.media import ImageInput, MediaError, load_image, message_images, placeholder_runs
from molt_capture.types import Segment


def png(size=(8, 6), colour=(200, 10, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def test_every_source_form_gives_the_image(tmp_path):
    data = png()
    path = tmp_path / "red.png"
    path.write_bytes(data)
    b64 = base64.b64encode(data).decode()
    forms = [Image.open(io.BytesIO(data)), data, {"bytes": data, "path": None},
             {"bytes": None, "path": str(path)}, f"data:image/png;base64,{b64}", str(path),
             f"file://{path}", b64]  # fmt: skip
    for form in forms:
        image = load_image(form)
        assert image.size == (8, 6) and image.convert("RGB").getpixel((0, 0)) == (200, 10, 10)


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("https://example.com/cat.png", "remote image URLs are not fetched"),
        ("data:text/plain;base64,aGk=", "data:image/<type>;base64"),
        ("not an image", "not a file path, data URL or base64 image"),
        (b"not an image", "not a decodable image"),
        ({"url": "x"}, "needs 'bytes' or 'path'"),
        (3.5, "unsupported image type float"),
        ("file:///nowhere/x.png", "does not exist"),
    ],
)
def test_bad_sources_are_named(source, says):
    with pytest.raises(MediaError, match="messages.0.content.1") as e:
        load_image(source, "messages.0.content.1")
    assert says in str(e.value)


def test_too_large_and_too_many_pixels(monkeypatch):
    monkeypatch.setattr(media, "MAX_IMAGE_BYTES", 64)
    with pytest.raises(MediaError, match="larger than 64 bytes"):
        load_image(png((64, 64), (1, 2, 3)) + b"\0" * 64)
    monkeypatch.setattr(media, "MAX_IMAGE_BYTES", 1 << 20)
    monkeypatch.setattr(media, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(MediaError, match="20x20 is more than 100 pixels"):
        load_image(png((20, 20)))


def test_message_images_take_inline_sources_then_the_rows_pool():
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"},
                                     {"type": "image_url", "image_url": {"url": "inline"}}]},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": [{"type": "image", "image": "own"}, {"type": "image"}]},
    ]  # fmt: skip
    assert message_images(messages, ["p0", "p1"]) == ["p0", "inline", "own", "p1"]
    with pytest.raises(MediaError, match="'images' are used up"):
        message_images(messages, ["p0"])
    with pytest.raises(MediaError, match="3 images but its messages have 2 image parts"):
        message_images(messages, ["p0", "p1", "p2"])
    assert message_images([{"role": "user", "content": "text only"}]) == []


def test_placeholder_runs():
    assert placeholder_runs([1, 9, 9, 2, 9, 3, 9, 9, 9], 9) == [(1, 2), (4, 1), (6, 3)]
    assert placeholder_runs([1, 2], 9) == []


def test_segment_carries_images_shifted_and_through_json():
    tensors = {"pixel_values": np.arange(6, dtype=np.float32).reshape(1, 2, 3),
               "pixel_attention_mask": np.ones((1, 3), dtype=np.int64)}  # fmt: skip
    image = ImageInput(offset=1, length=2, mm_hash=media.tensor_hash(tensors), tensors=tensors)
    seg = Segment()
    seg.append_context([5, 9, 9, 6])
    seg.append_context([7, 9, 9], [image])  # an observation: its offsets are its own
    assert [(i.offset, i.length) for i in seg.images] == [(5, 2)]
    back = Segment.from_dict(json.loads(json.dumps(seg.to_dict())))
    assert back.token_ids == seg.token_ids and back.images[0].offset == 5
    for name, array in tensors.items():
        assert back.images[0].tensors[name].dtype == array.dtype
        assert np.array_equal(back.images[0].tensors[name], array)
    assert media.tensor_hash(back.images[0].tensors) == image.mm_hash
    # A text segment is unchanged: no images, none in its dict but the empty list.
    assert (
        Segment().to_dict()["images"] == [] and Segment.from_dict(Segment().to_dict()).images == []
    )
