"""The actor for real: Ray actors, FSDP2 over gloo with two workers, the tiny Qwen3 model.

One two-worker policy group serves the module (its tests run in file order: the read-only ones
first, then the ones that train it); a one-worker group checks that the data-parallel split
does not change the update.
"""

import math

import numpy as np
import pytest
import torch

from molt_algos import AlgoConfig, KLConfig, LossConfig
from molt_train.actor_config import (
    ActorConfig,
    FSDPConfig,
    OptimConfig,
    lr_at,
    router_params,
    validate_actor_config,
    validate_actor_devices,
)
from molt_train.model_group import ModelGroup
from molt_train.packing import Sample

TOKEN_MEAN = AlgoConfig(aggregation="token-mean")  # ppo, as a resolved run config has it

# eps well above the fp32 noise of the tiniest gradients, whose Adam update g / (|g| + eps)
# would otherwise amplify summation-order differences between microbatch splits.
OPTIM = OptimConfig(
    lr=1e-3,
    warmup_steps=2,
    schedule="cosine",
    total_steps=6,
    min_lr=1e-4,
    max_grad_norm=0.5,
    eps=1e-5,
)
PPO_WIDE = LossConfig(clip_low=0.2, clip_high=10.0)  # no clipping in a few steps
KL_AND_ENTROPY = AlgoConfig(
    loss=PPO_WIDE, aggregation="token-mean", kl=KLConfig(loss_coef=0.01), entropy_coef=1e-3
)


def config(tiny_model: str, num_workers: int, **overrides) -> ActorConfig:
    fields = dict(
        model_path=tiny_model,
        num_workers=num_workers,
        max_tokens_per_microbatch=24,
        logprob_chunk_size=8,
        optim=OPTIM,
    )
    return ActorConfig(**{**fields, **overrides})


SHAPES = ((4, 6), (3, 9), (5, 2), (2, 12), (6, 5), (3, 3))  # (prompt, response) lengths


def make_samples(vocab: int, advantage: float = 1.0, shapes=SHAPES, seed: int = 1) -> list[Sample]:
    """Prompt + response rows of several lengths and two temperatures; by default more
    microbatches than one rank needs, and an odd count, so one rank also gets an empty
    padding microbatch."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i, (prompt, response) in enumerate(shapes):
        n = prompt + response
        ids = torch.randint(0, vocab, (n,), generator=generator).tolist()
        mask = [0] * prompt + [1] * response
        samples.append(
            Sample(
                token_ids=ids,
                loss_mask=mask,
                temperature=0.7 if i % 3 else 1.0,
                advantages=[advantage * m for m in mask],
            )
        )
    return samples


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


@pytest.fixture(scope="module")
def policy(ray_cluster, tiny_model):
    group = ModelGroup(config(tiny_model, 2), FSDPConfig(), on_gpu=False)
    yield group
    group.shutdown()


def reference_logprobs(model, sample: Sample) -> list[float]:
    ids = torch.tensor([sample.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0] / sample.temperature, dim=-1)
    values = [0.0] + logp[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist()
    return [v if m else 0.0 for v, m in zip(values, sample.loss_mask, strict=True)]


def test_validate_actor_config_names_the_flags():
    ok = ActorConfig(num_workers=4)
    validate_actor_config(ok, FSDPConfig())
    validate_actor_config(ok, FSDPConfig(tp_size=2))  # devices unknown yet (before Ray)
    validate_actor_devices(ok, FSDPConfig(tp_size=2, ep_size=2), 8)
    cases = [
        (ok, FSDPConfig(tp_size=3), "--fsdp.tp_size"),
        (ok, FSDPConfig(cp_size=2, tp_size=2), "--fsdp.cp_size"),
        (ActorConfig(optim=OptimConfig(schedule="cosine")), FSDPConfig(), "total_steps"),
        (ActorConfig(optim=OptimConfig(lr=1e-6, min_lr=1e-5)), FSDPConfig(), "min_lr"),
        (
            ActorConfig(optim=OptimConfig(warmup_steps=5, total_steps=5, schedule="linear")),
            FSDPConfig(),
            "total_steps must exceed",
        ),
    ]
    for actor, fsdp, message in cases:
        with pytest.raises(ValueError, match=message):
            validate_actor_config(actor, fsdp)
    device_cases = [
        (FSDPConfig(tp_size=2), 0, "need GPUs"),
        (FSDPConfig(ep_size=2), 0, "need GPUs"),
        (FSDPConfig(), 2, "exceeds the 2 GPUs"),
    ]
    for fsdp, gpus, message in device_cases:
        with pytest.raises(ValueError, match=message):
            validate_actor_devices(ok, fsdp, gpus)


def test_lr_schedule_shapes():
    linear = OptimConfig(lr=1.0, warmup_steps=2, schedule="linear", total_steps=6, min_lr=0.2)
    assert [lr_at(s, linear) for s in range(8)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2]
    )
    cosine = OptimConfig(lr=1.0, schedule="cosine", total_steps=4, min_lr=0.0)
    assert [lr_at(s, cosine) for s in range(5)] == pytest.approx(
        [1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5, 0.5 - 0.5 * math.cos(math.pi / 4), 0.0]
    )
    assert lr_at(100, OptimConfig(lr=0.3)) == 0.3


def test_router_selection():
    names = [
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.experts.0.up_proj.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.self_attn.q_proj.weight",
    ]
    assert router_params(names) == [
        "model.layers.0.mlp.gate.weight",
        "model.layers.1.mlp.gate.weight",
    ]


def test_packed_logprobs_match_hf_with_temperature(policy, hf_model):
    samples = make_samples(hf_model.config.vocab_size)
    got = policy.forward_logprobs(samples)
    for sample, values in zip(samples, got, strict=True):
        assert len(values) == len(sample.token_ids)
        expected = reference_logprobs(hf_model, sample)
        torch.testing.assert_close(torch.tensor(values), torch.tensor(expected), atol=1e-5, rtol=0)
    # The temperature really divides the logits: at 1.0 the same tokens get other values.
    cooled = samples[1]
    assert cooled.temperature == 0.7
    plain = Sample(token_ids=cooled.token_ids, loss_mask=cooled.loss_mask)
    assert not torch.allclose(
        torch.tensor(policy.forward_logprobs([plain])[0]), torch.tensor(got[1]), atol=1e-3
    )


def test_gathered_tensors_are_the_hf_state_dict(policy, hf_model):
    state = policy.full_state()["model"]
    expected = hf_model.state_dict()
    assert list(state) == list(expected)
    for name, tensor in expected.items():
        assert state[name].shape == tensor.shape, name
        torch.testing.assert_close(state[name], tensor, atol=0, rtol=0)


def test_shards_cast_before_their_gather_give_the_cast_state_dict(policy, hf_model):
    """The refit's and the export's 16-bit gather casts each shard first (half the bytes over
    the wire): on every rank, exactly the full fp32 tensors cast afterwards."""

    def gather(worker) -> dict[str, torch.Tensor]:
        return dict(worker.weights.named_full_tensors(gather_in=torch.bfloat16))

    expected = hf_model.state_dict()
    for state in policy._all(lambda rank, worker: worker.__ray_call__.remote(gather)):
        assert list(state) == list(expected)
        for name, tensor in expected.items():
            assert state[name].dtype == torch.bfloat16, name
            assert torch.equal(state[name], tensor.to(torch.bfloat16)), name


def test_the_bucketed_gather_cuts_uneven_row_blocks(policy):
    """Rows that do not divide by the ranks (5 rows: blocks of 3 and 2; 7: 4 and 3), two
    tensors in one bucket, a cast, a plain tensor between sharded ones, in state order."""

    def gather(worker) -> list[tuple[str, torch.Tensor]]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        from molt_train.weights_out import gather_full

        mesh = init_device_mesh("cpu", (2,))
        a, b = torch.arange(15.0).view(5, 3), torch.arange(7.0)

        def rows(t: torch.Tensor):
            return distribute_tensor(t, mesh, [Shard(0)])

        items = [("a16", rows(a), torch.bfloat16), ("plain", torch.ones(2), None),
                 ("b", rows(b), None), ("a", rows(a), None)]  # fmt: skip
        return list(gather_full(items, torch.device("cpu")))

    a, b = torch.arange(15.0).view(5, 3), torch.arange(7.0)
    want = [("a16", a.to(torch.bfloat16)), ("plain", torch.ones(2)), ("b", b), ("a", a)]
    for got in policy._all(lambda rank, worker: worker.__ray_call__.remote(gather)):
        assert [name for name, _ in got] == [name for name, _ in want]
        for (_, tensor), (_, expected) in zip(got, want, strict=True):
            assert tensor.dtype == expected.dtype and torch.equal(tensor, expected)


def test_two_workers_step_like_one_worker(policy, tiny_model, hf_model):
    """Microbatching and the data-parallel split leave the update unchanged: the loss of each
    microbatch is its share of the window's global token mean (times dp_size against FSDP's
    gradient averaging). Clipping uses the global norm: Adam's first moment after step one is
    (1 - beta1) times the clipped gradient."""
    samples = make_samples(hf_model.config.vocab_size)
    old = policy.forward_logprobs(samples)
    for i, (sample, values) in enumerate(zip(samples, old, strict=True)):
        # Every other sample had ratio e^0.3 > 1 + clip_high: PPO clips its tokens.
        shift = 0.3 if i % 2 else 0.05
        sample.old_logprobs = [v - shift * m for v, m in zip(values, sample.loss_mask, strict=True)]
    single = ModelGroup(
        config(tiny_model, 1, max_tokens_per_microbatch=40), FSDPConfig(), on_gpu=False
    )
    try:
        one = single.train_step(samples, TOKEN_MEAN)
        one_state = single.full_state()
    finally:
        single.shutdown()
    two = policy.train_step(samples, TOKEN_MEAN)
    two_state = policy.full_state()

    for key in (
        "loss/policy",
        "train/grad_norm",
        "loss/clip_frac",
        "loss/approx_kl",
        "loss/entropy",
    ):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    assert two["train/tokens"] == sum(s.num_trained for s in samples)
    assert two["train/lr"] == pytest.approx(lr_at(0, OPTIM))
    assert 0 < two["loss/clip_frac"] < 1
    for name, tensor in one_state["model"].items():
        torch.testing.assert_close(two_state["model"][name], tensor, atol=1e-6, rtol=0)
        assert not torch.equal(tensor, hf_model.state_dict()[name]), f"{name} did not move"

    exp_avg = torch.cat([s["exp_avg"].flatten() for s in two_state["optim"]["state"].values()])
    assert two["train/grad_norm"] > OPTIM.max_grad_norm  # the clip was active
    clipped = min(two["train/grad_norm"], OPTIM.max_grad_norm)
    assert exp_avg.norm().item() == pytest.approx((1 - OPTIM.betas[0]) * clipped, rel=1e-4)


def test_training_raises_chosen_logprobs_and_follows_the_schedule(policy, hf_model):
    """Positive advantages on fixed tokens: the policy learns to raise their log-probs, the
    surrogate loss falls, and the lr applied each step is the schedule's (warmup, cosine decay,
    min_lr floor), read back from the optimizer's param_groups."""
    samples = make_samples(hf_model.config.vocab_size)
    before = policy.forward_logprobs(samples)
    for sample, values in zip(samples, before, strict=True):
        sample.old_logprobs = values
        sample.ref_logprobs = values
    losses, lrs = [], []
    for _ in range(6):  # optimizer steps 1..6 of this group (step 0 ran in the previous test)
        metrics = policy.train_step(samples, KL_AND_ENTROPY)
        losses.append(metrics["loss/policy"])
        lrs.append(metrics["train/lr"])
    assert lrs == pytest.approx([lr_at(step, OPTIM) for step in range(1, 7)])
    assert lrs[-1] == pytest.approx(OPTIM.min_lr)
    assert losses[-1] < losses[0] < 0
    assert (
        metrics["loss/ref_kl"] > 0
        and "loss/entropy" in metrics
        and metrics["perf/peak_memory_gb"] > 0
    )
    after = policy.forward_logprobs(samples)
    gain = [
        a - b
        for s, x, y in zip(samples, after, before, strict=True)
        for a, b, m in zip(x, y, s.loss_mask, strict=True)
        if m
    ]
    assert sum(gain) / len(gain) > 0.05


def test_critic_learns_returns(ray_cluster, tiny_model, hf_model):
    critic = ModelGroup(
        config(tiny_model, 1, optim=OptimConfig(lr=3e-4)), FSDPConfig(), role="critic", on_gpu=False
    )
    try:
        samples = make_samples(hf_model.config.vocab_size)
        for sample in samples:
            sample.returns = [0.5 * m for m in sample.loss_mask]
        values = critic.forward_logprobs(samples)
        assert [len(v) for v in values] == [len(s.token_ids) for s in samples]
        assert all(
            v == 0.0
            for s, row in zip(samples, values, strict=True)
            for v, m in zip(row, s.loss_mask, strict=True)
            if not m
        )
        losses = [
            critic.train_step(samples, TOKEN_MEAN, value_clip=None)["loss/value"] for _ in range(4)
        ]
        assert losses[-1] < 0.2 * losses[0]
    finally:
        critic.shutdown()


def test_sft_trains_the_negative_log_likelihood(policy, hf_model):
    samples = make_samples(hf_model.config.vocab_size)
    for sample in samples:
        sample.advantages, sample.temperature = None, 1.0
    before = policy.forward_logprobs(samples)
    trained = [
        v
        for s, row in zip(samples, before, strict=True)
        for v, m in zip(row, s.loss_mask, strict=True)
        if m
    ]
    first = policy.train_step(samples, TOKEN_MEAN, sft=True)
    assert first["loss/policy"] == pytest.approx(-sum(trained) / len(trained), abs=1e-5)
    assert policy.train_step(samples, TOKEN_MEAN, sft=True)["loss/policy"] < first["loss/policy"]


def test_moe_replay_checkpointing_and_frozen_router(ray_cluster, tmp_path):
    """The tiny Qwen3-MoE with routing replay and a frozen router. The replayed experts drive
    the forward; activation checkpointing gives the same step (its backward recompute replays
    the same experts); the router's weights never move and the rest do."""
    from molt_rollout.engines.tiny_model import build_tiny_model

    moe = str(build_tiny_model(tmp_path / "tiny-qwen3-moe", moe=True))
    generator = np.random.default_rng(0)
    samples = make_samples(390)
    for sample in samples:  # two distinct experts of four per token and layer
        order = generator.random((len(sample.token_ids), 2, 4)).argsort(-1)
        sample.routed_experts = order[..., :2].astype(np.int16)
    steps, states = [], []
    for checkpointing in (False, True):
        cfg = config(moe, 1, gradient_checkpointing=checkpointing, freeze_moe_router=True)
        group = ModelGroup(cfg, FSDPConfig(), on_gpu=False, routing="replay")
        try:
            replayed = group.forward_logprobs(samples)
            plain = [Sample(s.token_ids, s.loss_mask, s.temperature) for s in samples]
            unreplayed = group.forward_logprobs(plain)  # the recorded experts were used:
            assert not all(map(np.array_equal, replayed, unreplayed))
            for sample, values in zip(samples, replayed, strict=True):
                sample.old_logprobs = values
            initial = group.full_state()["model"]
            steps.append(
                group.train_step(samples, AlgoConfig(loss=PPO_WIDE, aggregation="token-mean"))
            )
            states.append(group.full_state())
        finally:
            group.shutdown()
    for key in ("loss/policy", "train/grad_norm", "loss/entropy"):
        assert steps[1][key] == pytest.approx(steps[0][key], rel=1e-6), key
    assert [step["routing/agreement"] for step in steps] == [1.0, 1.0]  # the recorded experts
    routers = router_params(list(initial))
    assert routers == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    for name, tensor in states[1]["model"].items():
        torch.testing.assert_close(tensor, states[0]["model"][name], atol=1e-6, rtol=0)
        assert torch.equal(tensor, initial[name]) == (name in routers), name
    optimized = list(states[0]["optim"]["state"])
    assert optimized and not router_params(optimized)  # no Adam state for the router


def test_a_step_hands_back_the_old_logprobs_of_a_separate_pass(policy, hf_model):
    """Without a separate old-policy pass (molt_train.experience.reuses_training_forward) the
    two ranks' training forwards are the old policy: the log-probs they hand back, put back in
    the samples' order, are exactly those of the pass at the same weights. Runs last: it
    trains the module's group."""
    samples = make_samples(hf_model.config.vocab_size)
    old = policy.forward_logprobs(samples)
    for sample, values in zip(samples, old, strict=True):
        sample.rollout_logprobs = [
            v - 0.1 * m for v, m in zip(values, sample.loss_mask, strict=True)
        ]
    metrics, used = policy.train_step(samples, TOKEN_MEAN, return_logprobs=True)
    assert len(used) == len(old) and all(map(np.array_equal, used, old))
    assert metrics["train/tokens"] == sum(s.num_trained for s in samples)
