"""The processor applied once in the data path: the tiny VLM's ImageEncoder, and the Env
runner sending processed images with the ids (fake generator; the real engine and trainer
agreement is tests_integration/test_tiny_vlm.py)."""

from __future__ import annotations

import asyncio
import base64
import io

import anthropic
import numpy as np
import openai
import pytest
from PIL import Image

from molt_capture.media import ImageEncoder, MediaError, load_image_encoder
from molt_capture.testing import FakeGenerator
from molt_capture.types import Rollout
from molt_rollout.agents.agent import ChatAgent, ChatContext, Dropped, Env, Result
from molt_rollout.agents.chat_runner import ChatRunner
from molt_rollout.agents.env_runner import EnvRunner
from molt_rollout.config import RolloutConfig
from molt_rollout.engines.tiny_vlm import IMAGE_TOKENS, build_tiny_vlm


def png(colour, size=(30, 20)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> ImageEncoder:
    return load_image_encoder(str(build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "m")))


def image_chat(n: int) -> list[dict]:
    parts = [{"type": "image"}] * n + [{"type": "text", "text": "colour?"}]
    return [{"role": "user", "content": parts}]


def test_encode_expands_each_image_once(encoder):
    processor = encoder.processor
    text = processor.apply_chat_template(image_chat(2), add_generation_prompt=True, tokenize=False)
    prompt = encoder.encode(text, [png("red"), png("blue")])
    want = processor(
        text=[text],
        images=[[Image.open(io.BytesIO(png(c))) for c in ("red", "blue")]],
        return_tensors="np",
        add_special_tokens=False,
    )
    assert prompt.token_ids == want["input_ids"][0].tolist()
    assert prompt.token_ids.count(encoder.image_token_id) == 2 * IMAGE_TOKENS
    first, second = prompt.images
    for image in prompt.images:
        run = prompt.token_ids[image.offset : image.offset + image.length]
        assert run == [encoder.image_token_id] * IMAGE_TOKENS
    assert np.array_equal(first.tensors["pixel_values"], want["pixel_values"][0][:1])
    assert np.array_equal(second.tensors["pixel_values"], want["pixel_values"][0][1:])
    assert first.mm_hash != second.mm_hash
    assert encoder.encode(text, [png("red"), png("blue")]).images[0].mm_hash == first.mm_hash


def test_encode_refuses_mismatches_and_too_many(encoder):
    text = encoder.processor.apply_chat_template(
        image_chat(1), add_generation_prompt=True, tokenize=False
    )
    with pytest.raises(MediaError, match="2 images for 1 <image> tokens"):
        encoder.encode(text, [png("red"), png("red")])
    few = ImageEncoder(encoder.processor, "idefics3", max_images=1)
    two = encoder.processor.apply_chat_template(
        image_chat(2), add_generation_prompt=True, tokenize=False
    )
    with pytest.raises(MediaError, match="2 images, at most 1 per prompt"):
        few.encode(two, [png("red"), png("red")])
    with pytest.raises(MediaError, match="'qwen2_vl' model are not supported"):
        ImageEncoder(encoder.processor, "qwen2_vl")


class Looks(Env):
    async def step(self, state):
        if state.turn == 0:
            look = [{"role": "user", "content": [{"type": "image", "image": png("green")}]}]
            return Result(reward=0.0, observation=look, terminated=False)
        return Result(reward=1.0)


class Runner(EnvRunner):
    env_class = Looks


def test_env_runner_sends_the_segments_images(encoder):
    tokenizer = encoder.processor.tokenizer
    sent = []

    class Recording(FakeGenerator):
        async def __call__(self, ids, params, session_id, images=()):
            sent.append((list(ids), list(images)))
            return await super().__call__(ids, params, session_id)

    runner = Runner(
        Recording(tokenizer, ["It is red."]),
        tokenizer,
        RolloutConfig(max_len=200),
        image_encoder=encoder,
    )
    row = {"prompt": image_chat(1), "images": [{"bytes": png("red"), "path": None}]}
    rollout = asyncio.run(runner.run(row, "r", "g"))
    assert isinstance(rollout, Rollout), rollout
    (seg,) = rollout.segments
    assert len(seg.images) == 2
    (ids0, images0), (ids1, images1) = sent
    assert [i.mm_hash for i in images0] == [seg.images[0].mm_hash]
    assert [i.mm_hash for i in images1] == [i.mm_hash for i in seg.images]
    assert ids1 == seg.token_ids[: len(ids1)]
    for image in seg.images:
        assert seg.token_ids[image.offset] == encoder.image_token_id


def test_text_only_runner_drops_an_image_row_clearly(encoder):
    tokenizer = encoder.processor.tokenizer
    runner = Runner(FakeGenerator(tokenizer), tokenizer, RolloutConfig(max_len=200))
    row = {"prompt": image_chat(1), "images": [png("red")]}
    dropped = asyncio.run(runner.run(row, "r", "g"))
    assert isinstance(dropped, Dropped) and dropped.reason == "bad_row"
    assert "needs a multimodal model" in dropped.detail
    bad = {"prompt": image_chat(1), "images": ["https://example.com/x.png"]}
    runner.image_encoder = encoder
    dropped = asyncio.run(runner.run(bad, "r", "g"))
    assert dropped.reason == "bad_row" and "remote image URLs" in dropped.detail


class LooksThroughOpenAI(ChatAgent):
    """Sends the prompt (image parts as data URLs), then a local file as a second image."""

    def __init__(self, path: str):
        self.path = path

    async def run(self, ctx: ChatContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        async with client:
            messages = list(ctx.messages)
            first = await client.chat.completions.create(model=ctx.model, messages=messages)
            messages += [
                {"role": "assistant", "content": first.choices[0].message.content},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": f"file://{self.path}"}},
                        {"type": "text", "text": "and now?"},
                    ],
                },
            ]
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return Result(reward=1.0)


def test_chat_agent_image_url_parts_are_rendered_token_exactly(encoder, tmp_path):
    path = tmp_path / "green.png"
    path.write_bytes(png("green"))
    tokenizer = encoder.processor.tokenizer
    sent = []

    class Recording(FakeGenerator):
        async def __call__(self, ids, params, session_id, images=()):
            sent.append((list(ids), list(images)))
            return await super().__call__(ids, params, session_id)

    class Runner(ChatRunner):
        def make_agent(self):
            return LooksThroughOpenAI(str(path))

    runner = Runner(
        Recording(tokenizer, ["It is red."]),
        tokenizer,
        RolloutConfig(max_len=200, generator_timeout_s=10),
        image_encoder=encoder,
    )
    try:
        row = {"prompt": image_chat(1), "images": [{"bytes": png("red"), "path": None}]}
        rollout = asyncio.run(runner.run(row, "r", "g"))
    finally:
        runner.close()
    assert isinstance(rollout, Rollout), rollout
    (seg,) = rollout.segments  # the second turn extended the first: one segment, two images
    assert len(seg.turns) == 2 and len(seg.images) == 2
    # The first prompt is exactly what the Env form renders: the processor's ids and pixels.
    text = encoder.processor.apply_chat_template(
        image_chat(1), add_generation_prompt=True, tokenize=False
    )
    want = encoder.encode(text, [png("red")])
    assert sent[0][0] == want.token_ids and sent[0][1][0].mm_hash == want.images[0].mm_hash
    green = encoder.encode(encoder.image_token, [png("green")]).images[0]
    assert seg.images[1].mm_hash == green.mm_hash
    assert [i.mm_hash for i in sent[1][1]] == [i.mm_hash for i in seg.images]
    for image in seg.images:
        run = seg.token_ids[image.offset : image.offset + image.length]
        assert run == [encoder.image_token_id] * IMAGE_TOKENS
    assert sent[1][0] == seg.token_ids[: len(sent[1][0])]


def test_text_only_capture_server_keeps_the_clear_400(encoder):
    tokenizer = encoder.processor.tokenizer

    class Sends(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            async with client:
                with pytest.raises(openai.BadRequestError, match="needs a multimodal model"):
                    await client.chat.completions.create(
                        model=ctx.model,
                        messages=[
                            {
                                "role": "user",
                                "content": [
                                    {
                                        "type": "image_url",
                                        "image_url": {"url": "data:image/png;base64,AAAA"},
                                    }
                                ],
                            }
                        ],
                    )
            return Result(reward=0.0)

    class Runner(ChatRunner):
        agent_class = Sends

    runner = Runner(FakeGenerator(tokenizer), tokenizer, RolloutConfig(generator_timeout_s=10))
    try:
        result = asyncio.run(runner.run({"prompt": "hi"}, "r", "g"))
    finally:
        runner.close()
    assert isinstance(result, Dropped) and result.reason == "empty"


def assert_renders_as_the_openai_parts_do(encoder, send):
    """A ChatAgent whose `run` is `send(ctx)` (one red PNG and "colour?" through some wire)
    reaches the generator with the ids and image of the same chat as OpenAI parts; returns
    the rollout and that expected prompt."""
    tokenizer = encoder.processor.tokenizer
    sent = []

    class Recording(FakeGenerator):
        async def __call__(self, ids, params, session_id, images=()):
            sent.append((list(ids), list(images)))
            return await super().__call__(ids, params, session_id)

    class Sends(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            await send(ctx)
            return Result(reward=0.0)

    class Runner(ChatRunner):
        agent_class = Sends

    runner = Runner(
        Recording(tokenizer, ["red"]),
        tokenizer,
        RolloutConfig(max_len=200, generator_timeout_s=10),
        image_encoder=encoder,
    )
    try:
        rollout = asyncio.run(runner.run({"prompt": "unused"}, "r", "g"))
    finally:
        runner.close()
    assert isinstance(rollout, Rollout), rollout
    text = encoder.processor.apply_chat_template(
        image_chat(1), add_generation_prompt=True, tokenize=False
    )
    want = encoder.encode(text, [png("red")])
    ((ids, images),) = sent
    assert ids == want.token_ids and [i.mm_hash for i in images] == [want.images[0].mm_hash]
    return rollout, want


def test_anthropic_image_blocks_render_as_the_openai_parts_do(encoder):
    async def send(ctx: ChatContext) -> None:
        data = base64.b64encode(png("red")).decode()
        client = anthropic.AsyncAnthropic(
            base_url=ctx.anthropic_base_url, api_key=ctx.api_key, max_retries=0
        )
        async with client:
            await client.messages.create(
                model=ctx.model,
                max_tokens=4,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": data,
                                },
                            },
                            {"type": "text", "text": "colour?"},
                        ],
                    }
                ],
            )

    rollout, want = assert_renders_as_the_openai_parts_do(encoder, send)
    assert rollout.segments[0].images[0].mm_hash == want.images[0].mm_hash


def test_responses_input_image_renders_as_the_openai_parts_do(encoder):
    async def send(ctx: ChatContext) -> None:
        url = "data:image/png;base64," + base64.b64encode(png("red")).decode()
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        async with client:
            await client.responses.create(
                model=ctx.model,
                max_output_tokens=4,
                input=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_image", "image_url": url, "detail": "auto"},
                            {"type": "input_text", "text": "colour?"},
                        ],
                    }
                ],
            )

    assert_renders_as_the_openai_parts_do(encoder, send)
