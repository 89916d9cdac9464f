"""Reply parsing per markup family, and the template's end-of-turn tokens."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from molt_capture import ChatRenderer
from molt_capture.testing import ADD_TOOL, encode_noncanonical, tool_call_text
from molt_capture.tiny_tokenizer import QWEN3_STYLE_TEMPLATE, build_tiny_tokenizer

PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_build_is_deterministic(tmp_path, tokenizer):
    from transformers import PreTrainedTokenizerFast

    again = PreTrainedTokenizerFast.from_pretrained(build_tiny_tokenizer(tmp_path / "again"))
    text = "<think>\nsum\n</think>\n\n" + tool_call_text("add", {"a": 1})
    assert again.encode(text) == tokenizer.encode(text)
    assert again.chat_template == QWEN3_STYLE_TEMPLATE
    assert tokenizer.decode(encode_noncanonical(tokenizer, text)) == text
    assert encode_noncanonical(tokenizer, "hello world") != tokenizer.encode("hello world")


def test_qwen3_parses_reasoning_content_and_tool_calls(tokenizer):
    r = ChatRenderer(tokenizer, "qwen3")
    text = "<think>\nadd them\n</think>\n\nCalling.\n" + tool_call_text("add", {"a": 1, "b": 2})
    reply = r.parse(tokenizer.encode(text + "<|im_end|>"), PROMPT, None)
    assert reply.reasoning == "add them" and reply.content == "Calling."
    assert [(t.name, t.arguments) for t in reply.tool_calls] == [("add", {"a": 1, "b": 2})]
    two = tool_call_text("add", {"a": 1}) + "\n" + tool_call_text("add", {"a": 2})
    assert len(r.parse(tokenizer.encode(two), PROMPT, None).tool_calls) == 2


def test_qwen3_xml_family_casts_arguments_by_schema(tokenizer):
    r = ChatRenderer(tokenizer, "qwen3_xml")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    ]
    text = "<tool_call>\n<function=add>\n<parameter=a>\n7\n</parameter>\n</function>\n</tool_call><|im_end|>"
    reply = r.parse(tokenizer.encode(text), PROMPT, tools)
    assert [(t.name, t.arguments) for t in reply.tool_calls] == [("add", {"a": 7})]


def test_prefilled_empty_think_block_is_not_content(tokenizer):
    r = ChatRenderer(tokenizer, "qwen3", {"enable_thinking": False})
    prompt = r.render([{"role": "user", "content": "hi"}], None, add_generation_prompt=True)
    assert prompt.endswith("<think>\n\n</think>\n\n")
    reply = r.parse(tokenizer.encode("Hi there<|im_end|>"), prompt, None)
    assert reply.content == "Hi there" and not reply.reasoning


def test_broken_tool_markup_comes_back_as_text(tokenizer):
    r = ChatRenderer(tokenizer, "qwen3")
    reply = r.parse(
        tokenizer.encode("<tool_call>\n{not json\n</tool_call><|im_end|>"), PROMPT, None
    )
    assert (
        reply.tool_calls == []
        and "{not json" in reply.content
        and "<|im_end|>" not in reply.content
    )


def test_tool_choice_none_and_unusable_calls_come_back_as_text(tokenizer):
    r = ChatRenderer(tokenizer, "qwen3")
    call = tool_call_text("add", {"a": 1})
    reply = r.parse(tokenizer.encode(call + "<|im_end|>"), PROMPT, None, parse_tools=False)
    assert reply.tool_calls == [] and reply.content == call
    not_an_object = '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>'
    reply = r.parse(tokenizer.encode(not_an_object), PROMPT, None)
    assert reply.tool_calls == [] and reply.content == not_an_object


def test_stop_string_is_cut_from_the_reply(tokenizer):
    r = ChatRenderer(tokenizer, "qwen3")
    assert (
        r.parse(tokenizer.encode("one two STOP three"), PROMPT, None, "STOP").content == "one two"
    )


def test_closing_tokens(tokenizer):
    r = ChatRenderer(tokenizer, "qwen3")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    newline = tokenizer.encode("\n")
    assert r.closing_ids == [im_end, *newline]
    assert r.missing_closing([5, 6, im_end]) == newline  # the engine emitted the end marker
    assert r.missing_closing([5, 6]) == r.closing_ids  # stopped by a stop string or length


def test_unknown_parser_and_template_errors(tokenizer):
    with pytest.raises(ValueError, match="unknown parser"):
        ChatRenderer(tokenizer, "nope")
    with pytest.raises(ValueError, match="response_template"):
        ChatRenderer(tokenizer, "tokenizer")


MARKUP = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>", "<|endoftext|>"]
MARKUP += ["<|im_start|>", "\n", "x", "{", "}", "<function=add>", "<parameter=a>", "</parameter>"]
PAYLOADS = ["7", "[1]", "null", '"s"', '{"name": 5}', '{"arguments": {}}', '{"name": "add"}']
PAYLOADS += ['{"name": "add", "arguments": [1]}', '{"name": "add", "arguments": "{}"}']
PAYLOADS += [
    '{"name": "add", "arguments": {"a": NaN}}',
    '{"name": "add", "arguments": "[Infinity]"}',
]
MARKUP += [f"<tool_call>\n{p}\n</tool_call>" for p in PAYLOADS]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(pieces=st.lists(st.sampled_from(MARKUP), max_size=14), tools=st.booleans())
def test_any_model_output_parses_to_a_reply(tokenizer, pieces, tools):
    """Whatever the model writes, parsing returns a reply: never an exception (a 500 after the
    engine already answered)."""
    text = "".join(pieces)
    for family in ("qwen3", "qwen3_xml"):
        reply = ChatRenderer(tokenizer, family).parse(
            tokenizer.encode(text), PROMPT, [ADD_TOOL] if tools else None
        )
        assert isinstance(reply.content, str)
        for tc in reply.tool_calls:  # strict JSON objects, as every wire sends them
            assert isinstance(tc.arguments, dict) and json.dumps(tc.arguments, allow_nan=False)
