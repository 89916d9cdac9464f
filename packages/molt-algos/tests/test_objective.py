"""policy_objective / value_objective against the formulas written out, each term on and off."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from molt_algos import (
    AdvantageConfig,
    AggregationWindow,
    AlgoConfig,
    KLConfig,
    LossConfig,
    TokenInputs,
    policy_objective,
    value_objective,
)
from molt_algos.centering import CENTERING_METRICS

MASK = torch.tensor([[False, True, True, True], [False, True, True, False]])
N = 5  # trained tokens
WINDOW = AggregationWindow(num_tokens=N, num_sequences=2)
DP = 2
ADV = torch.tensor([[0.0, 1.0, -1.0, 0.5], [0.0, 2.0, -0.5, 0.0]])
OLD = torch.tensor([[0.0, -1.0, -1.3, -0.2], [0.0, -0.9, -2.5, 0.0]])
REF = torch.tensor([[0.0, -1.4, -1.0, -0.7], [0.0, -1.0, -1.9, 0.0]])
WEIGHTS = torch.tensor([[1.0, 0.8, 1.2, 1.0], [1.0, 1.0, 0.5, 1.0]])
BASE = torch.tensor([[-0.5, -1.2, -1.1, -0.4], [-0.3, -0.7, -2.2, -0.9]])
ENTROPY = torch.tensor([[0.3, 1.1, 0.7, 0.9], [0.2, 0.4, 1.6, 0.5]])
CLIP = LossConfig(clip_low=0.2, clip_high=0.2)


def forward():
    """The forward's outputs, leaves so that their gradients can be read."""
    return BASE.clone().requires_grad_(True), ENTROPY.clone().requires_grad_(True)


def mean(per_token: torch.Tensor) -> torch.Tensor:
    """Token-mean over the window, times DP (FSDP averages the ranks' gradients)."""
    return torch.where(MASK, per_token, 0.0).sum() / N * DP


def ppo_per_token(logprobs, old=OLD):
    ratio = (logprobs - old).exp()
    return -torch.minimum(ratio * ADV, ratio.clamp(0.8, 1.2) * ADV)


def objective(algo, **inputs):
    logprobs, entropy = forward()
    inputs = TokenInputs(MASK, **{"advantages": ADV, "old_logprobs": OLD, **inputs})
    out = policy_objective(logprobs, entropy, None, inputs, algo, WINDOW, DP)
    out.loss.backward()
    return out, logprobs.grad, entropy.grad


def direct(formula):
    logprobs, entropy = forward()
    loss = formula(logprobs, entropy)
    loss.backward()
    return loss, logprobs.grad, entropy.grad


def test_the_policy_loss_alone_is_the_weighted_token_mean():
    algo = AlgoConfig(aggregation="token-mean", loss=CLIP)
    out, grad, entropy_grad = objective(algo, weights=WEIGHTS)
    want, want_grad, _ = direct(lambda lp, _: mean(ppo_per_token(lp) * WEIGHTS))
    torch.testing.assert_close(out.loss, want)
    torch.testing.assert_close(grad, want_grad)
    assert entropy_grad is None  # no coefficient: no gradient through the entropy
    torch.testing.assert_close(out.totals["loss/policy"], want.detach() / DP)
    torch.testing.assert_close(out.per_token["loss/entropy"], ENTROPY[MASK].mean())
    assert "loss/ref_kl" not in out.per_token and torch.equal(out.old_logprobs, OLD)


@pytest.mark.parametrize("coef", [0.0, 0.1])
def test_the_entropy_bonus(coef):
    algo = AlgoConfig(aggregation="token-mean", loss=CLIP, entropy_coef=coef)
    out, grad, entropy_grad = objective(algo)
    want, want_grad, want_entropy_grad = direct(
        lambda lp, ent: mean(ppo_per_token(lp)) - coef * mean(ent)
    )
    torch.testing.assert_close(out.loss, want)
    torch.testing.assert_close(grad, want_grad)
    assert (entropy_grad is None) == (coef == 0)
    if coef:
        torch.testing.assert_close(entropy_grad, want_entropy_grad)


@pytest.mark.parametrize("coef", [0.0, 0.3])
def test_the_kl_term_is_k3_to_the_reference(coef):
    algo = AlgoConfig(aggregation="token-mean", loss=CLIP, kl=KLConfig(loss_coef=coef))
    out, grad, _ = objective(algo, ref_logprobs=REF)

    def k3(lp):
        log_ratio = lp - REF
        return torch.exp(-log_ratio) - 1 + log_ratio

    want, want_grad, _ = direct(lambda lp, _: mean(ppo_per_token(lp)) + coef * mean(k3(lp)))
    torch.testing.assert_close(out.loss, want)
    torch.testing.assert_close(grad, want_grad)
    assert ("loss/ref_kl" in out.per_token) == (coef > 0)
    if coef:
        torch.testing.assert_close(out.per_token["loss/ref_kl"], k3(BASE)[MASK].mean())


def test_rollout_logprobs_give_is_weights_from_the_forward():
    """No old log-probs: pi_old is the forward's (ratio 1), and the IS weights are
    min(pi_old / pi_rollout, threshold), detached."""
    rollout = BASE - torch.tensor([[0.0, 0.1, -0.2, 0.9], [0.0, 0.0, 1.0, 0.0]])
    algo = AlgoConfig(aggregation="token-mean", advantage=AdvantageConfig())  # token, trunc, 2.0
    out, grad, _ = objective(algo, old_logprobs=None, rollout_logprobs=rollout)
    weights = (BASE - rollout).exp().clamp(max=2.0)
    want, want_grad, _ = direct(lambda lp, _: mean(ppo_per_token(lp, lp.detach()) * weights))
    torch.testing.assert_close(out.loss, want)
    torch.testing.assert_close(grad, want_grad)
    assert torch.equal(out.old_logprobs, BASE)


def test_sft_is_the_negative_log_likelihood():
    logprobs, entropy = forward()
    algo = AlgoConfig(aggregation="token-mean", score_centering=True)
    inputs = TokenInputs(MASK, rollout_logprobs=BASE - 1.0)  # neither used by SFT
    out = policy_objective(logprobs, entropy, None, inputs, algo, WINDOW, DP, sft=True)
    torch.testing.assert_close(out.loss, mean(-BASE))
    assert set(out.per_token) == {"loss/entropy"}


def test_another_aggregation_per_term():
    algo = AlgoConfig(
        aggregation="seq-mean-token-sum",
        entropy_aggregation="token-mean",
        entropy_coef=0.5,
        loss=CLIP,
    )
    out, _, _ = objective(algo)
    policy = torch.where(MASK, ppo_per_token(BASE), 0.0).sum() / 2 * DP  # two sequences
    torch.testing.assert_close(out.loss, policy - 0.5 * mean(ENTROPY))


def test_score_centering_keeps_the_value_and_centres_the_gradient():
    policy_head = torch.tensor([[-1.0, -2.0]]).expand(2, 4, 2).contiguous()
    sampler = torch.log(torch.tensor([0.75, 0.25])).expand(2, 4, 2)
    algo = AlgoConfig(aggregation="token-mean", loss=CLIP, score_centering=True)
    logprobs, entropy = forward()
    head = policy_head.clone().requires_grad_(True)
    inputs = TokenInputs(MASK, ADV, OLD, sampler_head_logprobs=sampler)
    out = policy_objective(logprobs, entropy, head, inputs, algo, WINDOW, DP)
    out.loss.backward()
    plain, plain_grad, _ = direct(lambda lp, _: mean(ppo_per_token(lp)))
    torch.testing.assert_close(out.loss, plain)
    torch.testing.assert_close(logprobs.grad, plain_grad)
    # d loss / d log pi(j) = -c_t * mu~(j), c_t = -d loss / d log pi(y_t).
    expected = plain_grad[..., None] * torch.tensor([0.75, 0.25]) * -1.0
    torch.testing.assert_close(head.grad, torch.where(MASK[..., None], expected, 0.0))
    assert set(CENTERING_METRICS) <= set(out.per_token)


def test_a_padding_microbatch_reports_the_same_keys_and_nothing_to_train():
    algo = AlgoConfig(
        aggregation="token-mean", score_centering=True, entropy_coef=0.1, kl=KLConfig(loss_coef=0.2)
    )
    real, _, _ = objective(algo, ref_logprobs=REF)
    logprobs = torch.zeros(1, 1, requires_grad=True)
    empty = TokenInputs(torch.zeros(1, 1, dtype=torch.bool))
    padding = policy_objective(logprobs, torch.zeros(1, 1), None, empty, algo, WINDOW, DP)
    assert set(padding.per_token) == set(real.per_token)
    assert set(padding.totals) == set(real.totals)
    assert padding.loss.item() == 0.0 and padding.per_token["loss/centering_head_mass"] == 0.0


@pytest.mark.parametrize("clip", [None, 0.2])
def test_the_value_loss(clip):
    values = torch.tensor([[0.0, 0.5, 1.5, 0.1], [0.0, -0.4, 2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.4, 1.0, 0.0], [0.0, 0.0, 2.1, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    algo = AlgoConfig(aggregation="seq-mean-token-sum", value_aggregation="token-mean")
    inputs = TokenInputs(MASK, returns=returns, old_values=old)
    out = value_objective(values, inputs, algo, clip, WINDOW, DP)
    loss = (values - returns) ** 2
    if clip is not None:
        loss = torch.maximum(loss, (old + (values - old).clamp(-clip, clip) - returns) ** 2)
    torch.testing.assert_close(out.loss, mean(0.5 * loss))
    torch.testing.assert_close(out.totals["loss/value"], out.loss.detach() / DP)
    assert {"value/clip_frac", "value/error_mean", "value/mean"} == set(out.per_token)


class HostReads(TorchDispatchMode):
    """Ops that need a tensor's value on the host (on a GPU, each waits for its queue)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in ("aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero"):
            self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo"])
def test_nothing_is_read_back_to_the_host(policy_loss):
    algo = AlgoConfig(
        aggregation="token-mean",
        policy_loss=policy_loss,
        entropy_coef=0.1,
        kl=KLConfig(loss_coef=0.1),
        score_centering=True,
    )
    logprobs, entropy = forward()
    head = torch.randn(2, 4, 3, requires_grad=True)
    sampler = torch.log_softmax(torch.randn(2, 4, 3), -1)
    inputs = TokenInputs(MASK, ADV, None, BASE - 0.1, None, REF, sampler_head_logprobs=sampler)
    with HostReads() as reads:
        out = policy_objective(logprobs, entropy, head, inputs, algo, WINDOW, DP)
        out.loss.backward()
        value_objective(BASE.clone().requires_grad_(True), inputs, algo, 0.2, WINDOW, DP)
    assert reads.seen == []
