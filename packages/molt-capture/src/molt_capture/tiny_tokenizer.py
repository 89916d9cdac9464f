"""The embedded tiny tokenizer (byte-level BPE, Qwen3-style chat template), so no run or test
ever downloads one; molt-rollout's tiny model, the quickstart's policy, is built on it."""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Markup the model writes itself: added (never split) but not special, so decode keeps them.
MARKUP_TOKENS = [
    f"<{end}{tag}>" for tag in ("think", "tool_call", "tool_response") for end in ("", "/")
]
VOCAB_SIZE = 384
_BUILD_VERSION = "2"  # bump when the corpus, vocabulary or template changes

# Qwen3's layout (qwen3_style.jinja beside this file), every tag trimming the whitespace around
# it so the file's line breaks render as nothing. Earlier reasoning is dropped unless it follows
# the last user query (as Qwen3 does) or `preserve_thinking` is passed; `enable_thinking=False`
# pre-fills an empty think block.
QWEN3_STYLE_TEMPLATE = (Path(__file__).parent / "qwen3_style.jinja").read_text()

# Small but varied: chat words, JSON punctuation and digits so tool calls compress somewhat.
_CORPUS = [
    "You are a helpful assistant. The user asks a question and the assistant answers it.",
    "What is the weather in Paris today? It is sunny and 21 degrees.",
    'Call a function: {"name": "get_weather", "arguments": {"city": "Paris"}}',
    '{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}',
    "Let me think step by step. First add the numbers, then check the result.",
    "The answer is 42. 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 -1",
    "Hello! How can I help you? Thanks, goodbye. Yes, no, maybe.",
    "system user assistant tool description properties required string integer",
]


def build_tiny_tokenizer(path: str | Path) -> Path:
    """Train (once) and save the tiny tokenizer at `path`; load it with `PreTrainedTokenizerFast`
    (AutoTokenizer imports torch whenever torch is installed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    marker = path / "molt_tiny_tokenizer_version"
    if marker.exists() and marker.read_text() == _BUILD_VERSION:
        return path
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.add_tokens(MARKUP_TOKENS)
    fast.chat_template = QWEN3_STYLE_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    marker.write_text(_BUILD_VERSION)
    return path
