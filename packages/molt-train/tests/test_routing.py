"""MoE routing replay on the transformers path: the hook reproduces a router exactly when it
replays the router's own choice, routes through the replayed experts otherwise while the router
keeps its gradient; agreement counts the experts used against the engine's, replayed or not;
and microbatch routing lines up with packed and padded layouts."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from molt_rollout.engines.tiny_model import build_tiny_model
from molt_train.packing import Sample, pack
from molt_train.routing_replay import (
    agreement,
    install_replay_hooks,
    microbatch_routing,
    moe_routers,
    replaying,
    routing_array,
)

TOKENS = torch.tensor([[5, 9, 13, 40, 41, 42, 7, 8, 100, 101, 102, 3]])


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe", moe=True)


def load(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    routers = moe_routers(model)
    install_replay_hooks(routers)
    return model, routers


def own_choices(model, routers, tokens) -> torch.Tensor:
    """[layers, tokens, top_k] what each router picks by itself."""
    picked = {}
    handles = [
        router.register_forward_hook(lambda m, i, out, layer=layer: picked.update({layer: out[2]}))
        for layer, router in routers
    ]
    with torch.no_grad():
        model(tokens)
    for handle in handles:
        handle.remove()
    return torch.stack([picked[layer] for layer, _ in routers])


def test_routers_are_found_in_layer_order(moe_path, tiny_model):
    model, routers = load(moe_path)
    assert [layer for layer, _ in routers] == [0, 1]
    dense = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert moe_routers(dense) == []


def test_replaying_the_routers_own_choice_changes_nothing(moe_path):
    model, routers = load(moe_path)
    with torch.no_grad():
        reference = model(TOKENS).logits
    routing = own_choices(model, routers, TOKENS)
    with torch.no_grad(), replaying(routers, routing):
        replayed = model(TOKENS).logits
    torch.testing.assert_close(replayed, reference, rtol=0, atol=0)


def test_other_choices_route_through_those_experts_and_train_the_router(moe_path):
    model, routers = load(moe_path)
    own = own_choices(model, routers, TOKENS)
    other = torch.stack([(own[..., 0] + 1) % 4, (own[..., 0] + 2) % 4], dim=-1)  # never own[0]
    used = {}
    for layer, _ in routers:
        experts = model.model.layers[layer].mlp.experts
        experts.register_forward_hook(lambda m, inputs, out, layer=layer: used.update({layer: inputs[1]}))  # fmt: skip
    with replaying(routers, other):
        logits = model(TOKENS).logits
        logits.logsumexp(-1).sum().backward()
    for layer, _ in routers:
        assert torch.equal(used[layer], other[layer])
    with torch.no_grad():
        plain = model(TOKENS).logits
    assert not torch.allclose(plain, logits.detach())
    for _, router in routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    # Outside the block every router chooses by itself again.
    assert torch.equal(own_choices(model, routers, TOKENS), own)


def test_agreement_counts_the_experts_used_against_the_engines(moe_path):
    model, routers = load(moe_path)
    own = own_choices(model, routers, TOKENS)
    other = torch.stack([(own[..., 0] + 1) % 4, (own[..., 0] + 2) % 4], dim=-1)  # never own[0]
    pairs = len(routers) * TOKENS.shape[1]  # (token, layer) pairs

    def counted(routing, replay) -> list[int]:
        with torch.no_grad(), replaying(routers, routing, replay):
            model(TOKENS)
        return [int(n) for n in agreement(routers).values()]

    assert counted(own.flip(-1), replay=False) == [pairs, pairs]  # sets: the order is free
    assert counted(other, replay=False) == [0, pairs]
    assert counted(other, replay=True) == [pairs, pairs]  # the replayed experts were used
    unreported = other.clone()
    unreported[:, :3] = -1  # three tokens the engine reported no experts for: not compared
    assert counted(unreported, replay=True) == [pairs - 3 * len(routers)] * 2
    with torch.no_grad():
        model(TOKENS)  # outside the block: nothing to compare with
    assert [int(n) for n in agreement(routers).values()] == [0, 0]


def test_routing_array_marks_missing_rows():
    rows = [[[0, 1], [2, 3]], None, [[1, 2], [3, 0]], None]
    array = routing_array(rows)
    assert array.shape == (4, 2, 2) and array.dtype == np.int16
    assert (array[1] == -1).all() and array[2].tolist() == [[1, 2], [3, 0]]
    with pytest.raises(ValueError, match="no routed experts"):
        routing_array([None, None])


def test_microbatch_routing_follows_the_token_layout():
    a = routing_array([[[0, 1]], [[2, 3]], None])  # 3 tokens, 1 layer, top-2
    b = routing_array([[[3, 2]], None])
    packed = microbatch_routing([a, b], None)
    assert packed.shape == (1, 5, 2)
    # Missing rows and padding stay -1 (replaying routes them to experts 0..k-1).
    assert packed[0].tolist() == [[0, 1], [2, 3], [-1, -1], [3, 2], [-1, -1]]
    padded = microbatch_routing([a, b], 3)
    assert padded[0].tolist() == [[0, 1], [2, 3], [-1, -1], [3, 2], [-1, -1], [-1, -1]]

    samples = [
        Sample([1, 2, 3], [0, 1, 1], routed_experts=a),
        Sample([4, 5], [0, 1], routed_experts=b),
    ]
    assert torch.equal(pack(samples).routing, packed)
    assert torch.equal(pack(samples, padded=True).routing, padded)
    assert pack([Sample([1, 2], [0, 1])]).routing is None
    with pytest.raises(ValueError, match="routed_experts is set on some samples"):
        pack([samples[0], Sample([1, 2], [0, 1])])
    with pytest.raises(ValueError, match="routed_experts has 3 entries for 2 tokens"):
        Sample([1, 2], [0, 1], routed_experts=a)
