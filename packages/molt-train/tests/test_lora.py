"""LoRA (molt_train.lora) on the tiny Qwen3: the merged weights the engines get, what trains,
and the start-up refusals. The sharded two-worker run (resume, export) is in
test_checkpoint.py; the RL run through the CLI in tests_integration/test_train.py."""

import pytest
import torch
from nemo_automodel.components._peft.lora import apply_lora_to_linear_modules

from molt_train.actor_config import ActorConfig, FSDPConfig, LoRAConfig, validate_actor_config
from molt_train.lora import adapter_scales, merge_adapters, peft_config
from molt_train.model_worker import ModelWorker
from molt_train.weights_out import WeightsOut

LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=["*.q_proj", "*.v_proj", "*.down_proj"])


def lora_model(tiny_model: str, lora: LoRAConfig = LORA):
    """The tiny model with adapters whose B is random (AutoModel starts it at zero, which
    would make every merged weight equal W whatever the formula)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation="sdpa"
    )
    apply_lora_to_linear_modules(model, peft_config(lora))
    generator = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.1
    return model


def weights_of(model, lora: LoRAConfig = LORA) -> WeightsOut:
    """The weights of a plain (unsharded) adapted module: its gather needs no collectives."""
    return WeightsOut(model, torch.device("cpu"), 0, "", torch.float32, lora)


def test_merged_weights_are_w_plus_scaled_ba_under_the_base_names(tiny_model):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = lora_model(tiny_model)
    base = load_file(f"{tiny_model}/model.safetensors")
    merged = dict(weights_of(model).named_full_tensors())
    assert set(merged) == set(base)  # the checkpoint's names: what vLLM loads
    scale = LORA.alpha / LORA.rank
    adapted = [name for name, m in model.named_modules() if hasattr(m, "lora_A")]
    assert len(adapted) == 3 * model.config.num_hidden_layers
    for name, tensor in merged.items():
        if name.removesuffix(".weight") in adapted:
            layer = model.get_submodule(name.removesuffix(".weight"))
            b, a = layer.lora_B.weight, layer.lora_A.weight
            expected = base[name] + scale * torch.einsum("or,ri->oi", b, a)
            torch.testing.assert_close(tensor, expected, atol=1e-6, rtol=0)
            assert not torch.equal(tensor, base[name])
        elif name in base:
            assert torch.equal(tensor, base[name]), name  # frozen, never adapted

    # A plain model holding the merged weights is the adapted model: the same logits.
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    plain.load_state_dict(merged)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


def test_only_adapters_train_and_hold_optimizer_state(tiny_model):
    model = lora_model(tiny_model)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2)
    )
    model(ids).logits.logsumexp(-1).mean().backward()
    for name, param in model.named_parameters():
        assert (param.grad is not None) == (name in trainable), name
    # The worker's optimizer takes what requires a gradient: the adapters' state only.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    optimizer.step()
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in optimizer.state} == trainable


def test_merge_keeps_order_and_bias_and_refuses_a_missing_adapter():
    w, a, b, bias = torch.ones(3, 2), torch.ones(1, 2), torch.full((3, 1), 2.0), torch.zeros(3)
    named = [("x.weight", w), ("x.bias", bias), ("x.lora_A.weight", a), ("x.lora_B.weight", b),
             ("y.weight", w)]  # fmt: skip
    out = list(merge_adapters(named, {"x": 0.5}))
    assert [n for n, _ in out] == ["x.bias", "x.weight", "y.weight"]
    assert torch.equal(out[1][1], w + 0.5 * b @ a)  # 1 + 0.5 * 2 = 2 everywhere
    # A frozen W kept in bf16 (AutoModel on GPU): summed in fp32, returned in W's dtype.
    a_, b_ = torch.full((1, 2), 1e-3), torch.ones(3, 1)
    w16 = torch.ones(3, 2, dtype=torch.bfloat16)
    named16 = [("x.weight", w16), ("x.lora_A.weight", a_), ("x.lora_B.weight", b_)]
    ((_, merged16),) = merge_adapters(named16, {"x": 3.0})
    assert merged16.dtype == torch.bfloat16
    assert torch.equal(merged16, (w16.float() + 3.0 * b_ @ a_).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="without both adapters"):
        list(merge_adapters(named[:3], {"x": 0.5}))


def test_targets_that_match_no_linear_layer_are_refused(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    apply_lora_to_linear_modules(
        model, peft_config(LoRAConfig(rank=2, target_modules=["*.no_such_proj"]))
    )
    with pytest.raises(ValueError, match="--actor.lora.target_modules matches no linear"):
        adapter_scales(model)


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        (LoRAConfig(rank=-1), "--actor.lora.rank must be >= 0"),
        (LoRAConfig(rank=8, alpha=0.0), "--actor.lora.alpha must be > 0"),
        (LoRAConfig(rank=8, target_modules=[]), "--actor.lora.target_modules needs"),
        (LoRAConfig(rank=8, target_modules=["*"]), "matches lm_head"),
        (LoRAConfig(rank=8, target_modules=["*_proj", "lm_head"]), "matches lm_head"),
    ],
)
def test_bad_lora_settings_name_their_flags(lora, message):
    with pytest.raises(ValueError, match=message):
        validate_actor_config(ActorConfig(lora=lora), FSDPConfig())
    validate_actor_config(ActorConfig(lora=LoRAConfig(rank=8)), FSDPConfig())  # the defaults


def test_only_the_policy_is_adapted():
    cfg = ActorConfig(lora=LORA)
    for role, adapted in (("policy", True), ("reference", False), ("critic", False)):
        worker = ModelWorker(cfg, FSDPConfig(), role, 0, 1, on_gpu=False)
        assert (worker.lora is not None) == adapted, role


def test_the_adapter_refit_writes_what_merges_into_the_served_weights(tiny_model, tmp_path):
    """--actor.lora.refit adapter: the adapters leave under the checkpoint's layer names, and
    their PEFT files merged into the base checkpoint give exactly the merged refit's weights."""
    import json

    from safetensors.torch import load_file

    from molt_train.lora import write_adapter

    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=LORA.target_modules, refit="adapter")
    worker = weights_of(lora_model(tiny_model, lora), lora)  # checks the adapted layers' names
    assert set(worker.lora_scales) == set(adapter_scales(worker.model))
    base = load_file(f"{tiny_model}/model.safetensors")
    adapters = dict(worker.named_adapter_tensors(torch.float32))
    assert {n.rsplit(".lora_", 1)[0] + ".weight" for n in adapters} <= set(base)
    write_adapter(str(tmp_path / "v1"), adapters.items(), lora, tiny_model)
    files = load_file(tmp_path / "v1" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "v1" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    merged = dict(worker.named_full_tensors())
    scale = config["lora_alpha"] / config["r"]
    for key, a in files.items():
        if key.endswith(".lora_A.weight"):
            layer = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = files[f"base_model.model.{layer}.lora_B.weight"]
            expected = base[f"{layer}.weight"] + scale * (b @ a)
            torch.testing.assert_close(merged[f"{layer}.weight"], expected, atol=1e-6, rtol=0)

    worker.unconverted = {n for n in base if ".q_proj." not in n}  # as if q_proj were fused
    with pytest.raises(ValueError, match=r"--actor.lora.refit adapter: the adapted layer .*q_proj"):
        worker.check_adapter_names()
