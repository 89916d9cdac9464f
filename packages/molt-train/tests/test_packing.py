"""Packing: the token budget, the split across ranks, the tensors of one microbatch, and the
correctness that matters most: a packed forward gives each sequence the log-probs it gets alone."""

import numpy as np
import pytest
import torch

from molt_train.packing import (
    Sample,
    pack,
    pack_by_budget,
    plan_microbatches,
    unplan,
)


def sample(n: int, temperature: float = 1.0, trained_from: int = 1, **fields) -> Sample:
    return Sample(
        token_ids=[(7 * i + n) % 300 for i in range(n)],
        loss_mask=[int(i >= trained_from) for i in range(n)],
        temperature=temperature,
        **fields,
    )


def test_sample_validation():
    with pytest.raises(ValueError, match="loss_mask has"):
        Sample(token_ids=[1, 2], loss_mask=[0])
    with pytest.raises(ValueError, match="advantages has"):
        Sample(token_ids=[1, 2], loss_mask=[0, 1], advantages=[1.0])
    with pytest.raises(ValueError, match="no context"):
        Sample(token_ids=[1, 2], loss_mask=[1, 1])
    with pytest.raises(ValueError, match="temperature"):
        Sample(token_ids=[1, 2], loss_mask=[0, 1], temperature=0.0)
    assert sample(5, trained_from=2).num_trained == 3


def test_first_fit_decreasing_respects_the_budget():
    lengths = [5, 3, 8, 2, 7, 1, 4]
    bins = pack_by_budget(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 3  # 30 tokens in bins of 10: FFD finds the optimum here
    # A sequence over the budget cannot be split: it gets a bin of its own.
    assert pack_by_budget([12, 3], 10) == [[0], [1]]


def test_plan_gives_every_rank_the_same_number_of_microbatches():
    samples = [sample(n) for n in (9, 3, 8, 2, 7)] + [sample(4, temperature=0.7)]
    plan = plan_microbatches(samples, max_tokens=10, dp_size=2)
    assert len(plan) == 2 and len(plan[0]) == len(plan[1])
    placed = sorted(i for rank in plan for mb in rank for i in mb)
    assert placed == list(range(len(samples)))
    for rank in plan:
        for mb in rank:
            assert sum(len(samples[i].token_ids) for i in mb) <= 10
            assert len({samples[i].temperature for i in mb}) <= 1  # one temperature per row
    # Four microbatches of the four temperatures/bins: no padding needed, loads balanced.
    loads = [sum(len(samples[i].token_ids) for mb in rank for i in mb) for rank in plan]
    assert abs(loads[0] - loads[1]) <= 9


def test_plan_pads_ranks_with_empty_microbatches():
    plan = plan_microbatches([sample(5), sample(6), sample(7)], max_tokens=8, dp_size=2)
    assert [len(rank) for rank in plan] == [2, 2]
    assert sum(mb == [] for rank in plan for mb in rank) == 1
    plan = plan_microbatches([sample(5)], max_tokens=8, dp_size=4)
    assert sum(mb == [] for rank in plan for mb in rank) == 3


def test_unplan_restores_the_original_order():
    samples = [sample(n) for n in (4, 9, 2, 6, 3)]
    plan = plan_microbatches(samples, max_tokens=10, dp_size=2)
    results = [[[len(samples[i].token_ids) for i in mb] for mb in rank] for rank in plan]
    assert unplan(plan, results, len(samples)) == [4, 9, 2, 6, 3]


def test_pack_builds_one_row_with_restarting_positions():
    a = sample(3, advantages=[0.0, 1.0, 2.0])
    b = sample(2, advantages=[0.0, 5.0])
    batch = pack([a, b])
    assert batch.input_ids.tolist() == [a.token_ids + b.token_ids]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert batch.cu_seqlens.tolist() == [0, 3, 5] and batch.cu_seqlens.dtype == torch.int32
    assert batch.row_index.tolist() == [[0, 1, 2], [3, 4, 0]]
    assert batch.valid.tolist() == [[True, True, True], [True, True, False]]
    assert batch.inputs.mask.tolist() == [[False, True, True], [False, True, False]]
    assert batch.inputs.advantages.tolist() == [[0.0, 1.0, 2.0], [0.0, 5.0, 0.0]]
    assert batch.inputs.old_logprobs is None
    rows = batch.to_rows(torch.arange(5.0))
    assert rows.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 0.0]]
    per_sample = batch.per_sample(rows)  # 0.0 off the loss mask
    assert [a.tolist() for a in per_sample] == [[0.0, 1.0, 2.0], [0.0, 4.0]]
    # Arrays as well as lists: the batch is the same.
    arrays = [
        Sample(
            np.asarray(s.token_ids),
            np.asarray(s.loss_mask, dtype=bool),
            advantages=np.asarray(s.advantages, dtype=np.float32),
        )
        for s in (a, b)
    ]
    again = pack(arrays)
    assert torch.equal(again.input_ids, batch.input_ids)
    assert torch.equal(again.inputs.mask, batch.inputs.mask)
    assert torch.equal(again.inputs.advantages, batch.inputs.advantages)


def test_padded_rows_and_their_budget():
    a, b = sample(3), sample(2)
    batch = pack([a, b], padded=True)
    assert batch.input_ids.tolist() == [a.token_ids, b.token_ids + [0]]
    assert batch.position_ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert batch.to_rows(torch.arange(6.0).view(2, 3)).tolist() == [[0, 1, 2], [3, 4, 0]]
    # Padded rows cost count x longest: 5 + 5 fits a budget of 10, 5 + 4 + 1 does not.
    assert pack_by_budget([5, 4, 1], 10, padded=True) == [[0, 1], [2]]
    assert pack_by_budget([5, 4, 1], 10) == [[0, 1, 2]]
    plan = plan_microbatches([sample(5), sample(4), sample(1)], 10, 1, padded=True)
    assert sorted(len(mb) for mb in plan[0]) == [1, 2]


def test_pack_rejects_mixed_fields_and_temperatures():
    with pytest.raises(ValueError, match="advantages is set on some"):
        pack([sample(3, advantages=[0.0] * 3), sample(2)])
    with pytest.raises(ValueError, match="one temperature"):
        pack([sample(3), sample(2, temperature=0.5)])


def test_empty_batch_trains_nothing():
    batch = pack([])
    assert batch.input_ids.shape == (1, 2) and not batch.inputs.mask.any()


@pytest.mark.parametrize(
    "from_hidden,padded,documents",
    [(True, False, False), (False, False, False), (True, True, False), (True, False, True)],
)
def test_packed_forward_matches_one_sequence_at_a_time(tiny_model, from_hidden, padded, documents):
    """Block-diagonal attention from restarting position ids (transformers' packed-sequence
    detection, sdpa on CPU), document attention over the packed offsets (its CPU path, SDPA per
    document), or padded rows: every sequence gets exactly its solo log-probs."""
    from transformers import AutoModelForCausalLM

    from molt_train.attention import DOCUMENT_ATTENTION, document_attention, route_sdpa
    from molt_train.token_stats import packed_token_stats, packs_sequences

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation="sdpa"
    )
    assert packs_sequences(model)  # a transformers class: its mask code reads position ids
    if documents:
        assert route_sdpa(model, DOCUMENT_ATTENTION, document_attention)
    generator = torch.Generator().manual_seed(0)
    samples = []
    for n in (7, 1, 12, 2, 9):
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist()
        samples.append(Sample(token_ids=ids, loss_mask=[0] + [1] * (n - 1), temperature=0.8))
    with torch.no_grad():
        batch = pack(samples, padded=padded)
        stats = packed_token_stats(model, batch, 4, True, from_hidden=from_hidden)
        rows, entropy = stats.logprobs, stats.entropy
        packed = batch.per_sample(rows)
        for sample_, got, got_entropy in zip(samples, packed, entropy, strict=True):
            ids = torch.tensor([sample_.token_ids])
            logp = torch.log_softmax(model(ids).logits[0].float() / 0.8, dim=-1)
            expected = [0.0] + logp[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist()
            torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=0)
            expected_entropy = -(logp.exp() * logp).sum(-1)[:-1]
            n = len(sample_.token_ids)
            torch.testing.assert_close(got_entropy[1:n], expected_entropy, atol=1e-5, rtol=0)


def test_document_attention_on_cpu_is_sdpa_per_document():
    """The CPU path against SDPA given the block-diagonal causal mask outright, with GQA."""
    from molt_train.attention import document_attention, document_kwargs

    generator = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 3]
    total = sum(lengths)
    query = torch.randn(1, 4, total, 8, generator=generator)
    key, value = (torch.randn(1, 2, total, 8, generator=generator) for _ in range(2))
    batch = pack([sample(n) for n in lengths])
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    got, _ = document_attention(
        module, query, key, value, None, **document_kwargs(batch.cu_seqlens, lengths)
    )
    document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    position = torch.arange(total)
    mask = (document[:, None] == document[None, :]) & (position[:, None] >= position[None, :])
    want = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=mask
    ).transpose(1, 2)
    assert got.shape == (1, total, 4, 8)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_document_attention_varlen_matches_its_reference(monkeypatch):
    """torch's varlen FlashAttention (bf16 under autocast, fp32 q/k/v in, as the model's fp32
    norms and RoPE give them) against SDPA one document at a time in fp32, forward and
    backward."""
    from molt_train import attention
    from molt_train.attention import document_attention, document_kwargs

    generator = torch.Generator().manual_seed(0)
    lengths = [300, 1, 700, 23]
    total = sum(lengths)
    inputs = [torch.randn(1, h, total, 128, generator=generator) for h in (16, 8, 8)]
    kwargs = document_kwargs(pack([sample(n) for n in lengths], "cuda").cu_seqlens, lengths)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    calls = []
    varlen = attention.varlen_attention
    monkeypatch.setattr(
        attention, "varlen_attention", lambda *args: calls.append(1) or varlen(*args)
    )

    def run(autocast: bool):
        q, k, v = (x.cuda().requires_grad_(True) for x in inputs)
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            out, _ = document_attention(module, q, k, v, None, **kwargs)
        out.float().square().sum().backward()
        return [out.float(), q.grad, k.grad, v.grad]

    fast = run(autocast=True)
    assert len(calls) == 1  # varlen ran; fp32 without autocast takes the per-document path
    for got, want in zip(fast, run(autocast=False), strict=True):
        # bf16 against fp32: a few of 2M gradient elements differ by up to ~0.08 (measured on
        # an H200), so the bound is on the relative error of the whole tensor.
        assert ((got - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("padded", [False, True])
def test_candidate_logprobs_match_the_full_softmax(tiny_model, padded):
    """log pi(j) of the sampler's candidates from hidden states and the sampled token's
    log-prob equals log_softmax(z / tau)[j], value and gradient, packed or padded."""
    from transformers import AutoModelForCausalLM

    from molt_train.token_stats import packed_token_stats

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation="sdpa"
    )
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(3)
    samples = []
    for n in (6, 3, 9):
        ids = torch.randint(0, vocab, (n,), generator=generator).tolist()
        heads = [[] if t == 0 else torch.randint(0, vocab, (1 + t % 3,), generator=generator).tolist()
                 for t in range(n)]  # fmt: skip
        head_lps = [[-1.0] * len(row) for row in heads]
        samples.append(Sample(token_ids=ids, loss_mask=[0] + [1] * (n - 1), temperature=0.7,
                              head_ids=heads, head_logprobs=head_lps))  # fmt: skip
    batch = pack(samples, padded=padded)
    sampler_heads = batch.inputs.sampler_head_logprobs
    assert batch.head_ids.shape == (3, 9, 3) and torch.isinf(sampler_heads[0, 0]).all()
    stats = packed_token_stats(model, batch, 4, False)
    present = torch.isfinite(sampler_heads) & batch.inputs.mask[..., None]
    got = torch.where(present, stats.head_logprobs, torch.zeros_like(stats.head_logprobs))
    grads = torch.autograd.grad(got.sum(), list(model.parameters()), allow_unused=True)

    expected = []
    for i, sample in enumerate(samples):
        ids = torch.tensor([sample.token_ids])
        logp = torch.log_softmax(model(ids).logits[0].float() / 0.7, dim=-1)
        for t, row in enumerate(sample.head_ids):
            for k, j in enumerate(row):
                if sample.loss_mask[t]:
                    expected.append(logp[t - 1, j])
                    torch.testing.assert_close(
                        got[i, t, k], logp[t - 1, j].detach(), atol=1e-5, rtol=0
                    )
    want = torch.autograd.grad(
        torch.stack(expected).sum(), list(model.parameters()), allow_unused=True
    )
    for g, w in zip(grads, want, strict=True):
        if w is not None:
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_heads_must_be_on_every_sample_of_a_batch():
    with_head = Sample([1, 2], [0, 1], head_ids=[[], [2]], head_logprobs=[[], [-0.1]])
    with pytest.raises(ValueError, match="head_ids"):
        pack([with_head, Sample([1, 2], [0, 1])])
    with pytest.raises(ValueError, match="come together"):
        Sample([1, 2], [0, 1], head_ids=[[], [2]])
    with pytest.raises(ValueError, match="head_ids has 1 entries for 2 tokens"):
        Sample([1, 2], [0, 1], head_ids=[[2]], head_logprobs=[[-0.1]])
