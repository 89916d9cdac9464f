"""The embedded tiny vision-language model: deterministic build, cached re-use, and a
processor and chat template that expand one image part into its placeholders (no engine: the
engine and trainer agreement is tests_integration/test_tiny_vlm.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoProcessor

from molt_rollout.engines.tiny_vlm import IMAGE_TOKEN, IMAGE_TOKENS, build_tiny_vlm

FILES = (
    "model.safetensors",
    "config.json",
    "tokenizer.json",
    "processor_config.json",
    "chat_template.jinja",
)


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm")
    return {
        "a": build_tiny_vlm(root / "a"),
        "b": build_tiny_vlm(root / "b", seed=0),
        "seed1": build_tiny_vlm(root / "seed1", seed=1),
    }


def test_same_seed_gives_identical_bytes_and_small(builds):
    for name in FILES:
        assert (builds["a"] / name).read_bytes() == (builds["b"] / name).read_bytes(), name
    assert (builds["a"] / "model.safetensors").stat().st_size < 4 << 20
    other = (builds["seed1"] / "model.safetensors").read_bytes()
    assert other != (builds["a"] / "model.safetensors").read_bytes()


def test_a_second_build_reuses_the_first(builds):
    weights = builds["a"] / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert build_tiny_vlm(builds["a"]) == builds["a"]
    assert weights.stat().st_mtime_ns == mtime


def test_an_image_part_expands_to_its_placeholders(builds):
    from PIL import Image

    processor = AutoProcessor.from_pretrained(str(builds["a"]))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == f"<|im_start|>user\n{IMAGE_TOKEN}Hi<|im_end|>\n<|im_start|>assistant\n"
    batch = processor(text=[text], images=[Image.new("RGB", (30, 20), "red")], return_tensors="pt")
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert batch["input_ids"][0].tolist().count(image_id) == IMAGE_TOKENS
    assert tuple(batch["pixel_values"].shape[-3:]) == (3, 112, 112)
