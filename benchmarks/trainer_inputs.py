"""What the trainer benchmark and the trainer's GPU check train on: a random Qwen3 checkpoint (no
download), random samples of mixed lengths, and the loop's loss settings."""

import torch

QWEN3_1_7B = dict(vocab=151936, hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8)
TINY = dict(vocab=512, hidden=128, intermediate=256, layers=2, heads=2, kv_heads=1)  # CPU checks


def write_random_model(
    path: str,
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    experts: int = 0,
) -> None:
    """A Qwen3 of this shape with random weights, in bf16; `experts` > 0: a Qwen3-MoE (router
    `mlp.gate`, experts `mlp.experts.N.*`). Built on the current default device."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    if experts:
        config = Qwen3MoeConfig(
            num_experts=experts,
            num_experts_per_tok=2,
            moe_intermediate_size=intermediate // 4,
            **shape,
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=intermediate, **shape))
    model.to(torch.bfloat16).save_pretrained(path)
    print(f"wrote {path}")


def random_samples(vocab: int, count: int, length: int, seed: int, trained: float = 0.75) -> list:
    """`count` samples of about `length` tokens (mixed, as rollouts are): the last `trained`
    share trained, the rest prompt (an agent's rows: a quarter trained, the prompt and tool
    outputs the rest), advantages of alternating sign."""
    from molt_train.packing import Sample

    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        n = max(8, length - 37 * (i % 5))
        ids = torch.randint(0, vocab, (n,), generator=generator).tolist()
        prompt = n - max(1, round(n * trained))
        mask = [0] * prompt + [1] * (n - prompt)
        advantages = [(1.0 if i % 2 else -1.0) * m for m in mask]
        samples.append(Sample(token_ids=ids, loss_mask=mask, advantages=advantages))
    return samples


def rl_algo(entropy_coef: float = 0.0):
    """The run config's loss settings as the loop passes them: PPO, token-mean."""
    from molt_algos import AlgoConfig

    return AlgoConfig(aggregation="token-mean", entropy_coef=entropy_coef)
