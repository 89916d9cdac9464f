"""Every rank must report the same metric keys (they are all-reduced as one vector): a rank
whose microbatch is the empty padding one included. Without Ray or a model: the worker's
forward is replaced by fixed log-probs."""

import torch

from molt_algos import AggregationWindow, AlgoConfig
from molt_train.actor_config import ActorConfig, FSDPConfig
from molt_train.model_worker import ModelWorker
from molt_train.packing import Sample, pack
from molt_train.token_stats import TokenStats


def worker_with_fixed_logprobs() -> ModelWorker:
    worker = ModelWorker(ActorConfig(), FSDPConfig(), "policy", 0, 1, on_gpu=False)

    def token_stats(batch, with_entropy):
        mask = batch.inputs.mask
        logprobs = torch.full(mask.shape, -1.0, requires_grad=True)
        heads = batch.head_ids
        head = None if heads is None else logprobs[..., None].expand(*heads.shape) * 1.0
        return TokenStats(logprobs, torch.zeros(mask.shape), head)

    worker._token_stats = token_stats
    return worker


def test_a_padding_microbatch_reports_the_centering_keys():
    worker = worker_with_fixed_logprobs()
    algo = AlgoConfig(aggregation="token-mean", score_centering=True)
    sample = Sample([1, 2, 3], [0, 1, 1], advantages=[0.0, 1.0, -1.0],
                    old_logprobs=[0.0, -1.1, -0.9], weights=[1.0, 1.0, 1.0],
                    head_ids=[[], [2, 5], [3, 4]], head_logprobs=[[], [-0.2, -2.0], [-0.1, -3.0]])  # fmt: skip

    def keys(batch) -> set[str]:
        return set(worker._objective(batch, algo, AggregationWindow(), False, None).per_token)

    real, padding = keys(pack([sample])), keys(pack([]))
    assert "loss/centering_head_mass" in real
    assert real == padding
