"""One optimizer step over the batch: the old-policy log-probs are the training forward's own.
Skipping the separate pass must change nothing: the same loss, the same gradient of every
parameter, the same IS weights and metrics. Real tiny model on CPU, no process group (a world
of one without collectives: the worker's loss is called directly)."""

import dataclasses

import numpy as np
import pytest
import torch

from molt_algos import AggregationWindow
from molt_capture.types import Generation, Rollout, Segment
from molt_rollout.agents.pool import Batch, GroupResult
from molt_train.actor_config import ActorConfig, FSDPConfig
from molt_train.cli import QUICKSTART, parse
from molt_train.config import resolved
from molt_train.experience import correction_metrics, make_experience, reuses_training_forward
from molt_train.model_worker import ModelWorker
from molt_train.packing import pack


@pytest.fixture(scope="module")
def worker(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation="sdpa"
    )
    worker = ModelWorker(ActorConfig(), FSDPConfig(), "policy", 0, 1, on_gpu=False)
    worker.model = model
    return worker


class LocalPolicy:
    """ModelGroup.forward_logprobs over one in-process worker: one microbatch, its layout."""

    def __init__(self, worker):
        self.worker = worker

    def forward_logprobs(self, samples):
        return self.worker.forward_logprobs([samples])[0]


def rollouts(vocab: int) -> list[Rollout]:
    """Two groups of three, prompts of different lengths, 1-3 generated tokens sampled by
    log-probs far from the model's, so that truncation (rho > 2) bites on some tokens."""
    generator = torch.Generator().manual_seed(3)
    out = []
    for i in range(6):
        seg = Segment()
        seg.append_context(torch.randint(0, vocab, (4 + i,), generator=generator).tolist())
        n = 1 + i % 3
        ids = torch.randint(0, vocab, (n,), generator=generator).tolist()
        sampled = (-1.0 - 8.0 * torch.rand(n, generator=generator)).tolist()
        seg.append_generation(Generation(ids, sampled, "length", [0] * n), max_tokens=n)
        out.append(Rollout([seg], float(i % 2), rollout_id=f"r{i}", group_id=f"g{i // 3}"))
    return out


def batch_of(rollouts: list[Rollout]) -> Batch:
    groups = [GroupResult(task=None, rollouts=rollouts[:3]), GroupResult(None, rollouts[3:])]
    return Batch(groups=groups, metrics={}, dropped={})


def loss_and_grads(worker, samples, algo):
    worker.model.zero_grad(set_to_none=True)
    batch = pack(samples, padded=worker.padded)
    objective = worker._objective(batch, algo, AggregationWindow(), sft=False, value_clip=None)
    objective.loss.backward()
    grads = {name: p.grad.clone() for name, p in worker.model.named_parameters()}
    stats = {**objective.totals, **objective.per_token}
    return objective.loss.detach(), stats, grads, batch.per_sample(objective.old_logprobs)


@pytest.mark.parametrize("padded", [True, False])
def test_skipping_the_old_logprob_pass_changes_nothing(worker, padded):
    worker.padded = padded
    cfg = resolved(parse(QUICKSTART))
    assert reuses_training_forward(cfg)  # the quickstart takes the path without the pass
    batch = batch_of(rollouts(worker.model.config.vocab_size))
    policy = LocalPolicy(worker)

    with_pass = make_experience(batch, 0, cfg, 0.0, policy)
    without = make_experience(batch, 0, cfg, 0.0, policy, reuse_training_forward=True)
    assert all(s.old_logprobs is None and s.weights is None for s in without.samples)
    assert with_pass.metrics["is/ratio_max"] > 2  # the truncation bites
    loss_a, stats_a, grads_a, _ = loss_and_grads(worker, with_pass.samples, cfg.algo)
    loss_b, stats_b, grads_b, old_rows = loss_and_grads(worker, without.samples, cfg.algo)

    assert torch.equal(loss_a, loss_b)
    assert stats_a == stats_b
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    assert any(g.abs().sum() > 0 for g in grads_a.values())
    # The old log-probs the loss used, handed back, give the pass's IS metrics exactly.
    for got, expected in zip(old_rows, with_pass.samples, strict=True):
        assert np.array_equal(got, expected.old_logprobs)
    is_metrics = correction_metrics(without, old_rows, cfg.algo)
    assert is_metrics == {k: v for k, v in with_pass.metrics.items() if k.startswith("is/")}
    assert without.metrics == {k: v for k, v in with_pass.metrics.items() if k not in is_metrics}


def test_the_pass_is_skipped_only_when_it_is_exact():
    cfg = resolved(parse(QUICKSTART))

    def changed(section: str, **fields):
        return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section),
                                                                        **fields)})  # fmt: skip

    def is_mode(level: str, mode: str):
        advantage = dataclasses.replace(cfg.algo.advantage, is_correction_level=level,
                                        is_correction_mode=mode)  # fmt: skip
        return dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, advantage=advantage))

    assert reuses_training_forward(is_mode("off", "mask"))
    assert reuses_training_forward(is_mode("token", "clip"))
    for other in [
        changed("train", epochs_per_batch=2),  # the second epoch trains changed weights
        changed("train", mini_batches=2),  # so does the second mini-batch
        changed("ref", enable=True),  # the reference KL needs them before training
        is_mode("token", "mask"),  # dropped tokens change the step's token count
        is_mode("seq", "mask"),
    ]:
        assert not reuses_training_forward(other)
