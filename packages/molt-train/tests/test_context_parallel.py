"""Context parallelism for real: two gloo ranks of one CP group (FSDP2 over both, Ray actors,
the tiny Qwen3 model) give the log-probs, the metrics and the update of one rank that holds
whole rows; and the window layout each rank attends with."""

from dataclasses import replace

import pytest
import torch
from test_actor import KL_AND_ENTROPY, config, make_samples

from molt_train.actor_config import FSDPConfig
from molt_train.context_parallel import ContextShard, window
from molt_train.model_group import ModelGroup
from molt_train.packing import Sample, pack


def shard(rank: int, size: int = 2) -> ContextShard:
    return ContextShard(group=None, rank=rank, size=size)  # the layout needs no group


def test_windows_cut_documents_and_see_their_keys():
    """Lengths 5 + 4 = 9 tokens over two ranks: padded to 10 (the padding a document of its
    own), rank 0 holds 0..4, rank 1 holds 5..9; rank 1's queries see keys from 5 (its first
    document starts there) and rank 0's first document ends inside its window."""
    batch = pack([Sample(list(range(1, 6)), [0] * 5), Sample(list(range(6, 10)), [0] * 4)])
    (first, first_targets), (second, second_targets) = (
        window(batch, shard(0)),
        window(batch, shard(1)),
    )
    assert first["input_ids"].tolist() == [[1, 2, 3, 4, 5]]
    assert second["input_ids"].tolist() == [[6, 7, 8, 9, 0]]
    assert second["position_ids"].tolist() == [[0, 1, 2, 3, 0]]  # the padding restarts
    assert first_targets.tolist() == [[2, 3, 4, 5, 6]]
    assert second_targets.tolist() == [[7, 8, 9, 0, 0]]
    assert first["context_layout"].pieces == [(0, 5, 0, 5)]
    layout = second["context_layout"]
    assert (layout.key_start, layout.key_end) == (5, 10)
    assert layout.pieces == [(0, 4, 0, 4), (4, 5, 4, 5)]

    # Three ranks: 9 tokens, no padding; rank 1 (3..5) cuts both documents, and its first
    # document's queries 3, 4 see keys 0..4 (bottom-right: query 3 sees keys 0..3).
    layout = window(batch, shard(1, 3))[0]["context_layout"]
    assert (layout.key_start, layout.key_end) == (0, 6)
    assert layout.pieces == [(0, 2, 0, 5), (2, 3, 5, 6)]
    assert layout.cu_q.tolist() == [0, 2, 3] and layout.cu_k.tolist() == [0, 5, 6]
    assert (layout.max_q, layout.max_k) == (2, 5)


def row_attention(lengths: list[int], size: int, heads=(4, 2), dim=8, device="cpu"):
    """Random q/k/v of a packed row, its block-diagonal causal attention computed whole (the
    reference), and each rank's window layout of it."""
    generator = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(1, h, total, dim, generator=generator) for h in (*heads, heads[1]))
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    position = torch.arange(total)
    mask = (documents[:, None] == documents[None, :]) & (position[None, :] <= position[:, None])
    repeat = heads[0] // heads[1]
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), attn_mask=mask
    ).transpose(1, 2)
    batch = pack([Sample([1] * n, [0] * n) for n in lengths], device)
    layouts = [window(batch, shard(r, size))[0]["context_layout"] for r in range(size)]
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = repeat, True
    return (q, k, v), want, layouts, module


@pytest.mark.parametrize("size", [2, 3, 4])
def test_each_window_attends_like_the_whole_row(size):
    """Every rank's queries against the keys its layout names give the whole row's
    block-diagonal attention at its positions (GQA, documents cut anywhere; the padding's
    outputs are never read)."""
    from molt_train.context_parallel import local_attention

    lengths = [5, 1, 9, 3]
    (q, k, v), want, layouts, module = row_attention(lengths, size)
    width = -(-sum(lengths) // size)
    pad = width * size - sum(lengths)
    q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    got = []
    for rank, layout in enumerate(layouts):
        lo, hi = rank * width, (rank + 1) * width
        keys = slice(layout.key_start, layout.key_end)
        got.append(local_attention(module, q[:, :, lo:hi], k[:, :, keys], v[:, :, keys], layout))
    got = torch.cat(got, dim=1)[:, : sum(lengths)]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_window_attention_varlen_matches_its_reference(monkeypatch):
    """On CUDA in bf16 a window's attention is one varlen FlashAttention call whose causal
    mask is aligned bottom-right: against the fp32 piece-by-piece reference, forward and
    backward, on a window that cuts its first document."""
    from molt_train import attention
    from molt_train.context_parallel import local_attention

    lengths = [300, 1, 700, 23]
    inputs, _, layouts, module = row_attention(lengths, 2, (16, 8), 128, "cuda")
    layout = layouts[1]  # starts inside the 700-token document
    width = layout.key_end // 2
    calls = []
    varlen = attention.varlen_attention
    monkeypatch.setattr(
        attention, "varlen_attention", lambda *args: calls.append(1) or varlen(*args)
    )

    def run(autocast: bool):
        q, k, v = (x.cuda() for x in inputs)
        q = q[:, :, width:].contiguous().requires_grad_(True)
        keys = slice(layout.key_start, sum(lengths))
        k, v = (x[:, :, keys].contiguous().requires_grad_(True) for x in (k, v))
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            out = local_attention(module, q, k, v, layout)
        out.float().square().sum().backward()
        return [out.float(), q.grad, k.grad, v.grad]

    fast = run(autocast=True)
    assert len(calls) == 1
    for got, want in zip(fast, run(autocast=False), strict=True):
        assert ((got - want).norm() / want.norm()).item() < 1e-2


def long_samples(vocab: int) -> list[Sample]:
    """Documents longer than a window (so attention crosses ranks) and short ones, with
    advantages of both signs so that PPO's clipping acts on both sides."""
    samples = make_samples(vocab, shapes=[(7, 15), (3, 4), (12, 9), (2, 2), (5, 20)], seed=2)
    return [
        replace(s, advantages=[-0.5 * a for a in s.advantages]) if i % 3 == 0 else s
        for i, s in enumerate(samples)
    ]


def test_two_context_ranks_step_like_one_rank(ray_cluster, tiny_model):
    """Log-probs, the step's metrics and the updated weights of a CP group of two equal those
    of one rank (fp32, summation order aside), with the KL and entropy terms in the loss.
    Activation checkpointing on: the backward reruns each layer's forward, K/V gathers
    included, then differentiates through them (the path without it is the same autograd
    graph, built once)."""
    from transformers import AutoConfig

    def checkpointed(worker) -> bool:  # (local: Ray pickles it by value for the workers)
        return any("_checkpoint_wrapped_module" in n for n, _ in worker.model.named_modules())

    samples = long_samples(AutoConfig.from_pretrained(tiny_model).vocab_size)
    overrides = dict(max_tokens_per_microbatch=48, gradient_checkpointing=True)
    results = []
    for workers, fsdp in ((1, FSDPConfig()), (2, FSDPConfig(cp_size=2))):
        group = ModelGroup(config(tiny_model, workers, **overrides), fsdp, on_gpu=False)
        try:
            logprobs = group.forward_logprobs(samples)
            if not results:  # both groups train on the same inputs: the first one's
                for sample, values in zip(samples, logprobs, strict=True):
                    mask = sample.loss_mask
                    sample.old_logprobs = [v - 0.1 * m for v, m in zip(values, mask, strict=True)]
                    sample.ref_logprobs = [v + 0.05 * m for v, m in zip(values, mask, strict=True)]
            metrics = group.train_step(samples, KL_AND_ENTROPY)
            results.append((logprobs, metrics, group.full_state()["model"]))
            if fsdp.cp_size > 1:  # (a world of one checkpoints through transformers' own hook)
                assert all(
                    group._all(lambda rank, worker: worker.__ray_call__.remote(checkpointed))
                )
        finally:
            group.shutdown()
    (one_lp, one, one_state), (two_lp, two, two_state) = results
    for a, b in zip(one_lp, two_lp, strict=True):
        assert b == pytest.approx(a, abs=2e-6)
    for key in ("loss/policy", "train/grad_norm", "loss/clip_frac", "loss/entropy", "loss/ref_kl"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    assert two["train/tokens"] == one["train/tokens"]
    for name, tensor in one_state.items():
        torch.testing.assert_close(two_state[name], tensor, atol=1e-6, rtol=0)


def test_a_context_parallel_critic_values_whole_rows(ray_cluster, tiny_model):
    """The critic's value head reads each window's hidden states; gathered, they are the
    values of one rank holding whole rows."""
    from transformers import AutoConfig

    samples = long_samples(AutoConfig.from_pretrained(tiny_model).vocab_size)
    values = []
    for workers, fsdp in ((1, FSDPConfig()), (2, FSDPConfig(cp_size=2))):
        cfg = config(tiny_model, workers, max_tokens_per_microbatch=48)
        group = ModelGroup(cfg, fsdp, role="critic", on_gpu=False)
        try:
            values.append(group.forward_logprobs(samples))
        finally:
            group.shutdown()
    assert any(v != 0.0 for row in values[0] for v in row)
    for a, b in zip(*values, strict=True):
        assert b == pytest.approx(a, abs=2e-6)
