"""The embedded tiny tokenizer: a byte-level BPE trained on a small corpus and saved with a
Qwen3-style chat template (system, tools, tool calls, tool results, reasoning), so no run or
test ever downloads one. molt-rollout's tiny model is built on it (the quickstart's policy).
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Markup the model writes itself: added (never split) but not special, so decode keeps them.
MARKUP_TOKENS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
VOCAB_SIZE = 384
_BUILD_VERSION = "1"  # bump when the corpus, vocabulary or template changes

# Qwen3's layout, written with explicit '\n' strings so Jinja whitespace control cannot shift
# a byte. Earlier reasoning is dropped unless it follows the last user query (as Qwen3 does) or
# `preserve_thinking` is passed; `enable_thinking=False` pre-fills an empty think block.
QWEN3_STYLE_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions.\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    '{{- \'\\n</tools>\\n\\nCall a function as <tool_call>\\n{"name": <name>, "arguments": <json>}'
    "\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif messages and messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if m.reasoning_content and (loop.index0 > ns.last_query or preserve_thinking) -%}"
    "{{- '<think>\\n' + m.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- m.content or '' -}}"
    "{%- for tc in m.tool_calls or [] -%}"
    "{%- if not loop.first or m.content -%}{{- '\\n' -}}{%- endif -%}"
    '{{- \'<tool_call>\\n{"name": "\' + tc.function.name + \'", "arguments": \' -}}'
    "{%- if tc.function.arguments is string -%}{{- tc.function.arguments -}}"
    "{%- else -%}{{- tc.function.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}"
)

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
    """Train (once) and save the tiny tokenizer at `path`. Load it with
    `PreTrainedTokenizerFast.from_pretrained` (AutoTokenizer works too, but imports torch
    whenever torch is installed)."""
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
