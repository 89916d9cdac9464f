"""Score centering: the gradient equals the centred score, written token by token."""

import pytest
import torch

from molt_algos.aggregation import aggregate
from molt_algos.centering import CENTERING_METRICS, score_centering
from molt_algos.losses import POLICY_LOSSES, LossConfig

V, K = 11, 4


def problem(seed: int, rows: int = 3, length: int = 5):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(rows, length, 3, generator=gen)
    weight = torch.randn(3, V, generator=gen)
    sampler_logits = torch.randn(rows, length, V, generator=gen) * 2
    probs = sampler_logits.softmax(-1).reshape(-1, V)
    sampled = torch.multinomial(probs, 1, generator=gen).reshape(rows, length)
    sampler_lp = sampler_logits.log_softmax(-1)
    head_ids = sampler_lp.topk(K, dim=-1).indices
    sampler_head = sampler_lp.gather(-1, head_ids)
    sampler_head[0, 1, 2:] = -float("inf")  # a position whose head is shorter than K
    sampler_head[1, 0, :] = -float("inf")  # one with no head at all
    mask = torch.rand(rows, length, generator=gen) < 0.8
    mask[:, 0] = False
    advantages = torch.randn(rows, 1, generator=gen).expand(rows, length)
    weights = torch.rand(rows, length, generator=gen) + 0.5  # IS weights
    old = (features @ weight).log_softmax(-1).gather(-1, sampled[..., None])[..., 0]
    old = old + torch.randn(rows, length, generator=gen) * 0.3  # some tokens clip
    return features, weight, sampled, head_ids, sampler_head, mask, advantages, weights, old


def centred_loss(weight, p, loss_name="ppo"):
    features, _, sampled, head_ids, sampler_head, mask, advantages, weights, old = p
    lp_all = (features @ weight).log_softmax(-1)
    lp = lp_all.gather(-1, sampled[..., None])[..., 0]
    head = lp_all.gather(-1, head_ids)
    loss = POLICY_LOSSES[loss_name](lp, old, advantages, mask, LossConfig()).per_token * weights
    centred, metrics = score_centering(loss, lp, head, sampler_head, mask)
    return aggregate(centred, mask), aggregate(loss, mask), metrics


def reference_grad(weight, p):
    """Token by token: -c_t (d log pi(y_t) - sum_j mu~(j) d log pi(j)) / N, PPO's c_t =
    w_t r_t A_t where the unclipped term is the minimum, else 0."""
    features, _, sampled, head_ids, sampler_head, mask, advantages, weights, old = p
    total = torch.zeros_like(weight)
    n = int(mask.sum())
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                continue
            w = weight.clone().requires_grad_()
            lp_all = (features[b, t] @ w).log_softmax(-1)
            lp = lp_all[sampled[b, t]]
            ratio = (lp - old[b, t]).exp().item()
            a = advantages[b, t].item()
            clipped = min(max(ratio, 0.8), 1.2)
            c = weights[b, t].item() * ratio * a if ratio * a <= clipped * a else 0.0
            present = [j for j in range(K) if sampler_head[b, t, j] > -float("inf")]
            score = lp
            if present:
                mu = torch.stack([sampler_head[b, t, j] for j in present]).softmax(0)
                score = lp - sum(mu[i] * lp_all[head_ids[b, t, j]] for i, j in enumerate(present))
            (grad,) = torch.autograd.grad(score, w)
            total -= c * grad / n
    return total


@pytest.mark.parametrize("seed", range(4))
def test_gradient_is_the_centred_score(seed):
    torch.manual_seed(seed)
    p = problem(seed)
    w = p[1].clone().requires_grad_()
    centred, plain, metrics = centred_loss(w, p)
    assert centred.item() == pytest.approx(plain.item())  # the loss value is unchanged
    centred.backward()
    torch.testing.assert_close(w.grad, reference_grad(p[1], p), rtol=1e-5, atol=1e-6)
    assert 0.0 < metrics["loss/centering_head_mass"] <= 1.0 + 1e-6
    assert set(metrics) == set(CENTERING_METRICS)


def test_the_centred_score_is_zero_mean_under_the_sampler():
    # One position, the head is the whole vocabulary: E_{y ~ mu}[e_y - mu] = 0 on the logits.
    logits = torch.randn(V, requires_grad=True)
    mu = torch.randn(V).log_softmax(-1)
    expected = torch.zeros(V)
    for y in range(V):
        lp_all = logits.log_softmax(-1)
        lp = lp_all[y].reshape(1, 1)
        per_token = -lp  # REINFORCE with A = 1: c_t = 1
        centred, _ = score_centering(
            per_token, lp, lp_all.reshape(1, 1, V), mu.reshape(1, 1, V), torch.ones(1, 1).bool()
        )
        (grad,) = torch.autograd.grad(centred.sum(), logits)
        expected += mu[y].exp() * grad
    torch.testing.assert_close(expected, torch.zeros(V), atol=1e-6, rtol=0)


def test_masked_and_headless_positions_are_untouched():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    head = torch.tensor([[[-1.0, -3.0], [-2.0, -0.5]]], requires_grad=True)
    sampler = torch.tensor([[[-0.1, -2.0], [-float("inf"), -float("inf")]]])
    mask = torch.tensor([[False, True]])
    centred, metrics = score_centering(-lp * 2.0, lp, head, sampler, mask)
    centred.sum().backward()
    assert torch.all(head.grad == 0)  # position 0 masked, position 1 has no head
    assert lp.grad.tolist() == [[-2.0, -2.0]]
    assert metrics["loss/centering_head_mass"] == 0.0


def test_shapes_are_checked():
    lp = torch.zeros(1, 2, requires_grad=True)
    with pytest.raises(ValueError, match="head"):
        score_centering(
            lp * 1, lp, torch.zeros(1, 2, 3), torch.zeros(1, 2, 4), torch.ones(1, 2).bool()
        )
