"""SFT's loss mask: exactly the assistant turns, found from the model's own chat template."""

import pytest
from transformers import AutoTokenizer

from molt_train.sft import assistant_sample

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say seven."},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "And eight?"},
    {"role": "assistant", "content": "8"},
]


def masked_spans(sample, tokenizer) -> list[str]:
    spans, current = [], []
    for token, trained in zip(sample.token_ids, sample.loss_mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    if current:
        spans.append(tokenizer.decode(current))
    return spans


def test_mask_covers_exactly_the_assistant_turns(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    sample = assistant_sample(tokenizer, CONVERSATION, None, max_len=4096)
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert sample.token_ids == list(full)
    # Each answer with the template's end of turn; nothing of the prompts or system turn.
    spans = masked_spans(sample, tokenizer)
    assert len(spans) == 2
    assert spans[0].startswith("7") and spans[1].startswith("8")
    assert all("<|im_end|>" in span and "user" not in span for span in spans)


def test_truncation_keeps_the_mask_aligned(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    whole = assistant_sample(tokenizer, CONVERSATION, None, max_len=4096)
    cut = assistant_sample(tokenizer, CONVERSATION, None, max_len=len(whole.token_ids) - 3)
    assert cut.token_ids == whole.token_ids[:-3] and cut.loss_mask == whole.loss_mask[:-3]


def test_a_template_that_rewrites_history_is_refused(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    # Earlier assistant turns rendered differently once the conversation goes on.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[old]"
        "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match="turn 2 differently"):
        assistant_sample(tokenizer, CONVERSATION, None, max_len=4096)
