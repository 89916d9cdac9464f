"""Every rank must report the same metric keys (they are all-reduced as one vector): a rank
whose microbatch is the empty padding one included. Without Ray or a model: the worker's
forward is replaced by fixed log-probs."""

import torch

from molt_algos import AggregationWindow, aggregate
from molt_train.actor_config import ActorConfig, FSDPConfig
from molt_train.config import AlgoConfig
from molt_train.model_worker import ModelWorker
from molt_train.packing import Sample, empty_batch, pack
from molt_train.token_stats import TokenStats


def worker_with_fixed_logprobs() -> ModelWorker:
    worker = ModelWorker(ActorConfig(), FSDPConfig(), "policy", 0, 1, on_gpu=False)

    def token_stats(batch, with_entropy, head_ids=None):
        logprobs = torch.full(batch.loss_mask.shape, -1.0, requires_grad=True)
        head = None if head_ids is None else logprobs[..., None].expand(*head_ids.shape) * 1.0
        return TokenStats(logprobs, torch.zeros(batch.loss_mask.shape), head)

    worker._token_stats = token_stats
    return worker


def reduce(per_token, mask, loss):
    return aggregate(per_token, mask, "token-mean", window=AggregationWindow())


def test_a_padding_microbatch_reports_the_centering_keys():
    worker = worker_with_fixed_logprobs()
    algo = AlgoConfig(score_centering=True)
    sample = Sample([1, 2, 3], [0, 1, 1], advantages=[0.0, 1.0, -1.0],
                    old_logprobs=[0.0, -1.1, -0.9], weights=[1.0, 1.0, 1.0],
                    head_ids=[[], [2, 5], [3, 4]], head_logprobs=[[], [-0.2, -2.0], [-0.1, -3.0]])  # fmt: skip
    _, _, real, _ = worker._policy_loss(pack([sample]), reduce, algo, sft=False)
    _, _, padding, _ = worker._policy_loss(empty_batch(), reduce, algo, sft=False)
    assert "loss/centering_head_mass" in real
    assert set(real) == set(padding)
