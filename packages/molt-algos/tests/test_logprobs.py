"""Chunked log-probabilities and entropy against the naive full-vocabulary computation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import molt_algos.logprobs as logprobs_module
from molt_algos.logprobs import _slice_width, logprobs_from_logits, token_logprobs_and_entropy

TEMPERATURES = [0.6, 1.0, 1.7]
# 13 tokens: 1 and 3 and 5 leave a partial last block; 64 covers everything in one block.
CHUNK_SIZES = [1, 3, 5, 64]


def naive(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """The whole [T, V] in one tensor: what the chunked functions must reproduce."""
    logp = torch.log_softmax(logits / temperature, dim=-1)
    logprobs = logp.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logprobs, entropy


def make_inputs(tokens=13, vocab=37, width=8, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, width, generator=generator, dtype=torch.float64)
    # Scaled so logits spread over several nats, like a trained head's.
    weight = torch.randn(vocab, width, generator=generator, dtype=torch.float64) * 0.8
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    if tokens >= 2:
        targets[:2] = torch.tensor([0, vocab - 1])  # the first and last vocabulary slices
    return hidden.to(dtype), weight.to(dtype), targets


def grads_of(fn, inputs, upstream_lp, upstream_ent):
    """Gradients of Σ a·lp + Σ b·H with respect to `inputs` (b = None leaves H out)."""
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    logprobs, entropy = fn(*inputs)
    loss = (logprobs * upstream_lp).sum()
    if upstream_ent is not None:
        loss = loss + (entropy * upstream_ent).sum()
    loss.backward()
    return [x.grad for x in inputs]


def upstream(tokens, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(tokens, generator=generator, dtype=torch.float64),
        torch.randn(tokens, generator=generator, dtype=torch.float64),
    )


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_hidden_values_and_grads_match_naive(temperature, chunk_size):
    hidden, weight, targets = make_inputs()
    a, b = upstream(len(targets))

    def chunked(h, w):
        return token_logprobs_and_entropy(h, w, targets, temperature, chunk_size)

    def reference(h, w):
        return naive(h.double() @ w.double().T, targets, temperature)

    got_lp, got_ent = chunked(hidden, weight)
    want_lp, want_ent = reference(hidden, weight)
    assert got_lp.dtype == got_ent.dtype == torch.float32
    torch.testing.assert_close(got_lp.double(), want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_ent.double(), want_ent, rtol=1e-5, atol=1e-5)

    for b_or_none in (b, None):
        got = grads_of(
            chunked, [hidden, weight], a.float(), None if b_or_none is None else b.float()
        )
        want = grads_of(reference, [hidden.double(), weight.double()], a, b_or_none)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == torch.float32
            torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_logits_values_and_grads_match_naive(temperature, chunk_size):
    hidden, weight, targets = make_inputs()
    logits = hidden @ weight.T
    a, b = upstream(len(targets))

    def chunked(x):
        return logprobs_from_logits(x, targets, temperature, chunk_size)

    got_lp, got_ent = chunked(logits)
    want_lp, want_ent = naive(logits.double(), targets, temperature)
    torch.testing.assert_close(got_lp.double(), want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_ent.double(), want_ent, rtol=1e-5, atol=1e-5)

    for b_or_none in (b, None):
        (got,) = grads_of(chunked, [logits], a.float(), None if b_or_none is None else b.float())
        (want,) = grads_of(
            lambda x: naive(x, targets, temperature), [logits.double()], a, b_or_none
        )
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


def test_gradient_through_entropy_alone():
    hidden, weight, targets = make_inputs()
    _, b = upstream(len(targets))

    def chunked(h, w):
        return token_logprobs_and_entropy(h, w, targets, 0.8, chunk_size=4)

    def reference(h, w):
        return naive(h @ w.T, targets, 0.8)

    inputs = [x.detach().requires_grad_(True) for x in (hidden, weight)]
    (chunked(*inputs)[1] * b.float()).sum().backward()
    got = [x.grad for x in inputs]
    want = grads_of(reference, [hidden.double(), weight.double()], torch.zeros_like(b), b)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)


def test_gradcheck_in_float64():
    hidden, weight, targets = make_inputs(tokens=5, vocab=11, width=3, dtype=torch.float64)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda h, w: token_logprobs_and_entropy(h, w, targets, 1.3, chunk_size=2), (hidden, weight)
    )
    logits = (hidden @ weight.T).detach().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: logprobs_from_logits(x, targets, 0.7, chunk_size=2), (logits,)
    )


def test_entropy_can_be_skipped():
    hidden, weight, targets = make_inputs()
    a, _ = upstream(len(targets))
    logits = hidden @ weight.T
    want_lp, _ = naive(logits.double(), targets, 1.0)

    lp, entropy = token_logprobs_and_entropy(hidden, weight, targets, compute_entropy=False)
    assert entropy is None
    torch.testing.assert_close(lp.double(), want_lp, rtol=1e-5, atol=1e-5)
    lp, entropy = logprobs_from_logits(logits, targets, compute_entropy=False)
    assert entropy is None
    torch.testing.assert_close(lp.double(), want_lp, rtol=1e-5, atol=1e-5)

    def chunked(h, w):
        return token_logprobs_and_entropy(h, w, targets, chunk_size=3, compute_entropy=False)

    got = grads_of(chunked, [hidden, weight], a.float(), None)
    want = grads_of(
        lambda h, w: naive(h @ w.T, targets, 1.0), [hidden.double(), weight.double()], a, None
    )
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)


def test_gradient_only_where_required():
    hidden, weight, targets = make_inputs()
    weight.requires_grad_(True)  # a trainable head on frozen hidden states
    lp, entropy = token_logprobs_and_entropy(hidden, weight, targets, chunk_size=4)
    (lp.sum() + entropy.sum()).backward()
    assert hidden.grad is None
    assert weight.grad is not None and weight.grad.shape == weight.shape


def test_leading_dimensions_are_kept():
    hidden, weight, targets = make_inputs(tokens=12)
    lp, entropy = token_logprobs_and_entropy(
        hidden.view(3, 4, -1), weight, targets.view(3, 4), chunk_size=5
    )
    flat_lp, flat_entropy = token_logprobs_and_entropy(hidden, weight, targets, chunk_size=5)
    assert lp.shape == entropy.shape == (3, 4)
    torch.testing.assert_close(lp.reshape(-1), flat_lp)
    torch.testing.assert_close(entropy.reshape(-1), flat_entropy)

    logits = (hidden @ weight.T).view(3, 4, -1)
    lp, entropy = logprobs_from_logits(logits, targets.view(3, 4), chunk_size=5)
    assert lp.shape == entropy.shape == (3, 4)
    torch.testing.assert_close(lp.reshape(-1), flat_lp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [0, 1])
def test_zero_and_one_token(tokens):
    hidden, weight, targets = make_inputs(tokens=tokens)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    lp, entropy = token_logprobs_and_entropy(hidden, weight, targets, chunk_size=4)
    assert lp.shape == entropy.shape == (tokens,)
    want_lp, want_ent = naive(hidden.detach().double() @ weight.detach().double().T, targets, 1.0)
    torch.testing.assert_close(lp.double(), want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), want_ent, rtol=1e-5, atol=1e-5)
    (lp.sum() + entropy.sum()).backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape
    if tokens == 0:
        assert not weight.grad.any()

    logits = (hidden @ weight.T).detach().requires_grad_(True)
    lp, entropy = logprobs_from_logits(logits, targets, chunk_size=4)
    assert lp.shape == entropy.shape == (tokens,)
    (lp.sum() + entropy.sum()).backward()
    assert logits.grad.shape == logits.shape


def test_bfloat16_inputs_within_tolerance():
    """bf16 in, float32 out: compared with the naive path on the same bf16 logits."""
    hidden, weight, targets = make_inputs(tokens=40, vocab=300, width=32, dtype=torch.bfloat16)
    a, b = upstream(len(targets))

    def chunked(h, w):
        return token_logprobs_and_entropy(h, w, targets, 0.9, chunk_size=16)

    def reference(h, w):
        return naive((h @ w.T).float(), targets, 0.9)

    got_lp, got_ent = chunked(hidden, weight)
    want_lp, want_ent = reference(hidden, weight)
    assert got_lp.dtype == got_ent.dtype == torch.float32
    # Logits are rounded to bf16 in both; the remaining differences are matmul blocking.
    torch.testing.assert_close(got_lp, want_lp, rtol=0.02, atol=0.05)
    torch.testing.assert_close(got_ent, want_ent, rtol=0.02, atol=0.05)

    got = grads_of(chunked, [hidden, weight], a.float(), b.float())
    want = grads_of(
        lambda h, w: naive(h @ w.T, targets, 0.9), [hidden.double(), weight.double()], a, b
    )
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        scale = w.abs().max()
        assert (g.double() - w).abs().max() <= 0.05 * scale

    logits = hidden @ weight.T
    got_lp, got_ent = logprobs_from_logits(logits, targets, 0.9, chunk_size=16)
    want_lp, want_ent = naive(logits.float(), targets, 0.9)
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_ent, want_ent, rtol=1e-5, atol=1e-5)
    (got,) = grads_of(lambda x: logprobs_from_logits(x, targets, 0.9, 16), [logits], a, b)
    (want,) = grads_of(lambda x: naive(x.float(), targets, 0.9), [logits], a, b)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=1e-3)


def test_logits_input_is_not_modified():
    hidden, weight, targets = make_inputs()
    logits = hidden @ weight.T
    before = logits.clone()
    logprobs_from_logits(logits, targets, temperature=0.5, chunk_size=4)
    assert torch.equal(logits, before)


def test_invalid_arguments_raise():
    hidden, weight, targets = make_inputs()
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        logprobs_from_logits(hidden @ weight.T, targets, chunk_size=0)
    with pytest.raises(ValueError, match="does not match"):
        token_logprobs_and_entropy(hidden, weight[:, :-1], targets)
    with pytest.raises(ValueError, match="dtype"):
        token_logprobs_and_entropy(hidden, weight.double(), targets)
    with pytest.raises(ValueError, match="target_ids"):
        token_logprobs_and_entropy(hidden, weight, targets[:-1])


def test_backward_slices_are_aligned():
    # 8K-token microbatches (docs/performance.md): ceil(1024 V / T) is 18,995 columns at T = 8191.
    assert _slice_width(1024, 151936, 8191) == 19000
    assert _slice_width(1024, 151936, 8192) == 18992  # already a multiple of 8
    assert _slice_width(5, 37, 13) == 16  # 15 rounded up
    assert _slice_width(64, 37, 13) == 37  # never wider than the vocabulary
    assert _slice_width(4, 37, 0) == 37


def test_aligned_slices_give_the_unaligned_results(monkeypatch):
    """Rounding the slice width up (15 -> 16 columns here, a partial last slice either way)
    changes how the backward walks the vocabulary, not what it computes."""
    hidden, weight, targets = make_inputs(dtype=torch.float64)
    a, b = upstream(len(targets))

    def chunked(h, w):
        return token_logprobs_and_entropy(h, w, targets, 0.8, chunk_size=5)

    results = {}
    for align in (1, logprobs_module.SLICE_ALIGN):
        monkeypatch.setattr(logprobs_module, "SLICE_ALIGN", align)
        results[align] = [*chunked(hidden, weight), *grads_of(chunked, [hidden, weight], a, b)]
    unaligned, aligned = results.values()
    for got, want in zip(aligned[:2], unaligned[:2], strict=True):  # the forward is untouched
        assert torch.equal(got, want)
    for got, want in zip(aligned[2:], unaligned[2:], strict=True):  # sums in another order
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


# Shapes (ragged, one row or column, none), temperatures and seeds for the hypothesis sweeps.
ANY_SHAPE = dict(
    tokens=st.integers(0, 20),
    vocab=st.integers(1, 50),
    chunk_size=st.integers(1, 25),
    temperature=st.floats(0.25, 4.0),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=25, deadline=None)
@given(**ANY_SHAPE)
def test_any_shape_matches_naive(tokens, vocab, chunk_size, temperature, seed):
    hidden, weight, targets = make_inputs(tokens, vocab, 6, torch.float64, seed)
    a, b = upstream(tokens, seed + 1)

    def chunked(h, w):
        return token_logprobs_and_entropy(h, w, targets, temperature, chunk_size)

    def reference(h, w):
        return naive(h @ w.T, targets, temperature)

    for got, want in zip(chunked(hidden, weight), reference(hidden, weight), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    got = grads_of(chunked, [hidden, weight], a, b)
    want = grads_of(reference, [hidden, weight], a, b)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-8)


def test_the_block_functions_compile_whole_and_match_eager():
    """On CUDA the two per-block functions run compiled by Inductor (logprobs._fused). Here
    they compile for CPU the same way (one graph each: a graph break fails) on bf16 blocks with
    ragged shapes and give eager's values; test_cuda_matches_naive checks the CUDA build."""
    generator = torch.Generator().manual_seed(3)
    stats = logprobs_module._block_stats.__wrapped__
    grad = logprobs_module._logit_grad.__wrapped__
    compiled_stats = torch.compile(stats, dynamic=True, fullgraph=True)
    compiled_grad = torch.compile(grad, dynamic=True, fullgraph=True)
    for rows, vocab in [(7, 37), (16, 50)]:
        logits = (torch.randn(rows, vocab, generator=generator) * 3).bfloat16()
        targets = torch.randint(0, vocab, (rows,), generator=generator)
        want = stats(logits, targets, 0.7, True)
        got = compiled_stats(logits, targets, 0.7, True)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        lse, logp, entropy = want
        g_lp, g_ent = torch.randn(2, rows, generator=generator)
        for k in [
            logprobs_module._coefficients(g_lp, g_ent, logp, entropy, 0.7),
            logprobs_module._coefficients(g_lp, None, logp, entropy, 0.7),
        ]:
            # Targets shifted as for a vocabulary slice: some fall outside the block.
            args = (logits, lse, k, targets - vocab // 3, 0.7)
            torch.testing.assert_close(compiled_grad(*args).float(), grad(*args).float())


@settings(max_examples=25, deadline=None)
@given(**ANY_SHAPE, with_entropy=st.booleans())
def test_compiled_dispatch_takes_any_shape(
    tokens, vocab, chunk_size, temperature, seed, with_entropy
):
    """The CUDA dispatch with CPU blocks treated as CUDA (Inductor's CPU backend), over shapes
    that each can be a graph of their own, with dynamo's recompile limit at 2 so that it is
    reached: a call past it must run, not fail (with fullgraph=True a sweep of the whole test
    file hit the default limit of 8), and every result matches the naive computation."""
    hidden, weight, targets = make_inputs(tokens, vocab, 6, torch.float64, seed)
    a, b = upstream(tokens, seed + 1)

    def chunked(h, w):
        lp, entropy = token_logprobs_and_entropy(
            h, w, targets, temperature, chunk_size, with_entropy
        )
        return lp, entropy if with_entropy else torch.zeros_like(lp)

    def reference(h, w):
        lp, entropy = naive(h @ w.T, targets, temperature)
        return lp, entropy if with_entropy else torch.zeros_like(lp)

    with pytest.MonkeyPatch.context() as patch, torch._dynamo.config.patch(recompile_limit=2):
        patch.setattr(logprobs_module, "_compiles", lambda logits: min(logits.shape) > 1)
        results = [*chunked(hidden, weight), *grads_of(chunked, [hidden, weight], a, b)]
    want = [*reference(hidden, weight), *grads_of(reference, [hidden, weight], a, b)]
    for got, expected in zip(results, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cuda_matches_naive(temperature):
    """The CUDA path runs the block functions compiled; same answers as on CPU."""
    hidden, weight, targets = make_inputs(tokens=50, vocab=1000, width=64)
    a, b = upstream(len(targets))

    def chunked(h, w):
        return token_logprobs_and_entropy(h, w, targets.cuda(), temperature, chunk_size=16)

    def reference(h, w):
        return naive(h.double() @ w.double().T, targets, temperature)

    got = chunked(hidden.cuda(), weight.cuda())
    for g, w in zip(got, reference(hidden, weight), strict=True):
        torch.testing.assert_close(g.double().cpu(), w, rtol=1e-4, atol=1e-4)
    got = grads_of(chunked, [hidden.cuda(), weight.cuda()], a.float().cuda(), b.float().cuda())
    want = grads_of(reference, [hidden.double(), weight.double()], a, b)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double().cpu(), w, rtol=1e-3, atol=1e-4)

    logits = (hidden @ weight.T).bfloat16().cuda()
    lp, entropy = logprobs_from_logits(logits, targets.cuda(), temperature, chunk_size=16)
    want_lp, want_ent = naive(logits.float().cpu(), targets, temperature)
    torch.testing.assert_close(lp.cpu(), want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.cpu(), want_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bfloat16_hidden_path_matches_naive():
    """The training path on GPU: bf16 hidden states and head, compiled blocks, a ragged last
    block and an odd vocabulary; against the naive computation on the same bf16 logits."""
    hidden, weight, targets = make_inputs(tokens=700, vocab=5003, width=128, dtype=torch.bfloat16)
    # Logits of a few nats, as with width 8 elsewhere; at width 128 they would reach ~50, where
    # bf16's rounding of the logits alone (0.12) moves the gradients by more than the bound.
    hidden, weight, targets = hidden.cuda() / 4, weight.cuda(), targets.cuda()
    a, b = (x.float().cuda() for x in upstream(len(targets)))

    def chunked(h, w):
        return token_logprobs_and_entropy(h, w, targets, 0.9, chunk_size=256)

    got_lp, got_ent = chunked(hidden, weight)
    want_lp, want_ent = naive((hidden @ weight.T).float(), targets, 0.9)
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_ent, want_ent, rtol=1e-4, atol=1e-4)
    got = grads_of(chunked, [hidden, weight], a, b)
    want = grads_of(
        lambda h, w: naive(h @ w.T, targets, 0.9), [hidden.double(), weight.double()], a, b
    )
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        assert (g.double() - w).abs().max() <= 0.05 * w.abs().max()
