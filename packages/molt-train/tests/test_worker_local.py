"""ModelWorker and WeightsOut on CPU without a process group or Ray: the refit/export gather,
the log-prob inputs under autocast, the entropy term of the policy loss, and a microbatch's
loss reading nothing back to the host."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import molt_algos.logprobs as logprobs_module
import molt_train.token_stats as token_stats
from molt_algos import AggregationWindow, AlgoConfig
from molt_train.actor_config import ActorConfig, FSDPConfig
from molt_train.model_worker import ModelWorker
from molt_train.packing import Sample, pack
from molt_train.weights_out import WeightsOut


def load(tmp_path, moe=False):
    from transformers import AutoModelForCausalLM

    from molt_rollout.engines.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny", moe=moe)
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )


def worker_over(model) -> ModelWorker:
    """A policy worker around a plain (unsharded) module: its methods need no collectives."""
    worker = ModelWorker(
        ActorConfig(logprob_chunk_size=4), FSDPConfig(), "policy", 0, 1, on_gpu=False
    )
    worker.model = model
    return worker


def weights_of(model) -> WeightsOut:
    """The weights of a plain (unsharded) module: its gathers need no collectives."""
    return WeightsOut(model, torch.device("cpu"), 0, "", torch.float32)


def per_tensor_gather(model, dtype):
    """The gather as it was: transformers' revert_weight_conversion called on every tensor."""
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in model.state_dict().items():
        yield from revert_weight_conversion(model, {name: tensor.detach().to(dtype)}).items()


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_gather_matches_one_conversion_call_per_tensor(tmp_path, moe, dtype):
    model = load(tmp_path, moe)
    weights = weights_of(model)
    got = list(weights.named_full_tensors(dtype))
    want = list(per_tensor_gather(model, dtype or torch.float32))
    assert [name for name, _ in got] == [name for name, _ in want]
    for (name, tensor), (_, expected) in zip(got, want, strict=True):
        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), name

    # The dense model converts nothing; the MoE one splits its fused experts per expert.
    as_is = weights.unconverted
    fused = {name for name in model.state_dict() if ".mlp.experts." in name}
    assert as_is == set(model.state_dict()) - fused
    assert bool(fused) == moe
    if moe:
        assert any(".mlp.experts.0.gate_proj.weight" in name for name, _ in got)


def samples(vocab: int) -> list[Sample]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for n in (7, 12, 5):
        ids = torch.randint(0, vocab, (n,), generator=generator).tolist()
        mask = [0] + [1] * (n - 1)
        out.append(Sample(token_ids=ids, loss_mask=mask, temperature=0.9, advantages=mask))
    return out


def test_logprob_inputs_take_the_autocast_dtype(tmp_path, monkeypatch):
    """Under autocast the chunked log-prob function gets compute-dtype hidden states and head
    (its backward would otherwise run in fp32); without autocast, as before, fp32."""
    model = load(tmp_path)
    batch = pack(samples(model.config.vocab_size))
    seen = []
    original = token_stats.token_logprobs_and_entropy

    def spy(hidden, weight, *args):
        seen.append((hidden.dtype, weight.dtype))
        return original(hidden, weight, *args)

    monkeypatch.setattr(token_stats, "token_logprobs_and_entropy", spy)
    token_stats.packed_token_stats(model, batch, 4, True)
    with torch.autocast("cpu", torch.bfloat16):
        rows = token_stats.packed_token_stats(model, batch, 4, True).logprobs
    rows.sum().backward()
    assert seen == [(torch.float32,) * 2, (torch.bfloat16,) * 2]
    assert model.lm_head.weight.grad.dtype == torch.float32  # the master weight's gradient


@pytest.mark.parametrize("entropy_coef", [0.0, 0.1])
def test_entropy_gets_a_gradient_only_with_a_coefficient(tmp_path, monkeypatch, entropy_coef):
    """At coefficient 0 the log-prob backward runs without the entropy's terms (no gradient
    reaches it); `loss/entropy` is reported either way."""
    model = load(tmp_path)
    worker = worker_over(model)
    batch = pack(samples(model.config.vocab_size))  # on-policy: no old log-probs
    grads_of_entropy = []
    original = logprobs_module._coefficients

    def spy(grad_logprobs, grad_entropy, *args):
        grads_of_entropy.append(grad_entropy)
        return original(grad_logprobs, grad_entropy, *args)

    monkeypatch.setattr(logprobs_module, "_coefficients", spy)

    algo = AlgoConfig(aggregation="token-mean", entropy_coef=entropy_coef)
    objective = worker._objective(batch, algo, AggregationWindow(), sft=False, value_clip=None)
    objective.loss.backward()
    assert (grads_of_entropy[0] is None) == (entropy_coef == 0)
    assert objective.per_token["loss/entropy"] > 0


class HostReads(TorchDispatchMode):
    """The ops that need a tensor's value on the host: on a GPU each waits for its queue."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in ("aten::_local_scalar_dense", "aten::nonzero"):
            self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo"])
def test_a_microbatch_loss_reads_nothing_back_to_the_host(tmp_path, monkeypatch, policy_loss):
    """Between a microbatch's forward and the end of its backward nothing is read back (item,
    tolist, nonzero): each read would make a GPU step wait mid-step (docs/performance.md).
    Covered: every policy loss's metrics, the one-step path's IS weights (rollout
    log-probs, no old ones) and score centering; the step reads all metrics once, after the
    optimizer. (The forward is run before: on CPU transformers' SDPA path checks the position
    ids for packing on the host; the GPU's document attention skips that check.)"""
    model = load(tmp_path)
    worker = worker_over(model)
    parts = samples(model.config.vocab_size)
    for sample in parts:
        sample.rollout_logprobs = [-1.0] * len(sample.token_ids)
        sample.head_ids = [[1, 2]] * len(sample.token_ids)
        sample.head_logprobs = [[-0.5, -1.5]] * len(sample.token_ids)
    batch = pack(parts)
    algo = AlgoConfig(aggregation="token-mean", policy_loss=policy_loss, score_centering=True,
                      entropy_coef=0.01)  # fmt: skip

    forward = worker._token_stats(batch, True)
    monkeypatch.setattr(worker, "_token_stats", lambda *args, **kwargs: forward)
    listed = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: listed.append(1) or original(t))
    with HostReads() as reads:
        objective = worker._objective(batch, algo, AggregationWindow(), sft=False, value_clip=None)
        objective.loss.backward()
    assert reads.seen == [] and listed == []
    stats = objective.per_token
    assert "loss/centering_head_mass" in stats and "loss/clip_frac" in stats
    assert all(torch.is_tensor(v) for v in stats.values())
