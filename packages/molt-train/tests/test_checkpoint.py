"""Checkpoints: atomic saves, retention, an exact resume of a real two-worker actor, HF export.

The directory logic is checked with a stand-in actor group that writes one file (isolated from
the actor: CheckpointManager only calls save/load on it); `test_resume_is_exact` is its real
counterpart with a two-worker ModelGroup.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from molt_algos import AlgoConfig
from molt_train.actor_config import ActorConfig, FSDPConfig, LoRAConfig, OptimConfig
from molt_train.checkpoint import CheckpointManager
from molt_train.model_group import ModelGroup
from molt_train.packing import Sample

TOKEN_MEAN = AlgoConfig(aggregation="token-mean")  # ppo, as a resolved run config has it


class FileGroup:
    """Writes `weights.txt` holding its value; `crash` raises midway through a save."""

    def __init__(self, value: str, crash: bool = False) -> None:
        self.value, self.crash = value, crash

    def save(self, path: str) -> None:
        os.makedirs(path)
        Path(path, "weights.txt").write_text(self.value)
        if self.crash:
            raise RuntimeError("killed mid-save")

    def load(self, path: str) -> None:
        self.value = Path(path, "weights.txt").read_text()


def test_save_is_atomic_and_a_stale_tmp_is_cleaned(tmp_path):
    manager = CheckpointManager(str(tmp_path), keep_last=3)
    assert manager.latest() is None
    first = manager.save(10, {"policy": FileGroup("a")}, {"step": 10})
    assert first == str(tmp_path / "step_00000010") and manager.latest() == first
    with pytest.raises(RuntimeError, match="mid-save"):
        manager.save(20, {"policy": FileGroup("b", crash=True)}, {"step": 20})
    assert (tmp_path / "step_00000020.tmp").is_dir()  # what the crash left
    assert manager.latest() == first  # ... is never taken for a checkpoint
    group = FileGroup("")
    assert manager.load(manager.latest(), {"policy": group}) == {"step": 10}
    assert group.value == "a"
    manager.save(30, {"policy": FileGroup("c")}, {"step": 30})
    assert not (tmp_path / "step_00000020.tmp").exists()
    assert manager.load(manager.latest(), {}) == {"step": 30}


def test_retention_keeps_the_last_n(tmp_path):
    manager = CheckpointManager(str(tmp_path), keep_last=2)
    for step in (1, 2, 3, 4):
        manager.save(step, {"policy": FileGroup(str(step))}, {"step": step})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    # Saving a step that exists again (a resumed run) replaces it.
    manager.save(4, {"policy": FileGroup("again")}, {"step": 4, "again": True})
    assert json.loads((tmp_path / "step_00000004" / "driver_state.json").read_text())["again"]
    assert (tmp_path / "step_00000004" / "policy" / "weights.txt").read_text() == "again"


def make_samples(vocab: int) -> list[Sample]:
    generator = torch.Generator().manual_seed(2)
    samples = []
    for prompt, response in [(3, 7), (5, 4), (2, 9), (4, 4), (6, 3)]:
        ids = torch.randint(0, vocab, (prompt + response,), generator=generator).tolist()
        mask = [0] * prompt + [1] * response
        advantages = [float(torch.randn((), generator=generator)) * m for m in mask]
        samples.append(Sample(token_ids=ids, loss_mask=mask, advantages=advantages))
    return samples


def assert_same_state(got: dict, expected: dict) -> None:
    assert got["steps"] == expected["steps"]
    for name, tensor in expected["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    for key, state in expected["optim"]["state"].items():
        for field, value in state.items():
            assert torch.equal(got["optim"]["state"][key][field], value), (key, field)


@pytest.mark.parametrize(
    "lora", [LoRAConfig(), LoRAConfig(rank=4, alpha=8.0)], ids=["full", "lora"]
)
def test_resume_is_exact_and_exports_to_hf(ray_cluster, tiny_model, tmp_path, lora):
    """Save after one step, step again; a new group loaded from the checkpoint holds the saved
    weights and Adam state, and its next step gives the same metrics and weights as the run
    that went on. The export then loads with transformers and gives the actor's log-probs.
    With LoRA the weights are the merged ones the engines get, Adam holds the adapters' state
    alone, and the adapter export rebuilds the merged export from the base checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = ActorConfig(
        model_path=tiny_model,
        num_workers=2,
        max_tokens_per_microbatch=16,
        optim=OptimConfig(lr=1e-3, warmup_steps=3),
        lora=lora,
    )
    samples = make_samples(AutoTokenizer.from_pretrained(tiny_model).vocab_size)
    manager = CheckpointManager(str(tmp_path / "ckpt"), keep_last=3)
    group = ModelGroup(cfg, FSDPConfig(), on_gpu=False)
    try:
        group.train_step(samples, TOKEN_MEAN)
        path = manager.save(1, {"policy": group}, {"step": 1})
        saved = group.full_state()
        expected = group.train_step(samples, TOKEN_MEAN)
        after = group.full_state()
    finally:
        group.shutdown()

    resumed = ModelGroup(cfg, FSDPConfig(), on_gpu=False)
    try:
        assert manager.load(manager.latest(), {"policy": resumed}) == {"step": 1}
        assert manager.latest() == path
        assert_same_state(resumed.full_state(), saved)
        metrics = resumed.train_step(samples, TOKEN_MEAN)
        # Everything but the process's memory peak; lr (warmup step 2 of 3): the scheduler resumed.
        for metrics_ in (metrics, expected):
            metrics_.pop("perf/peak_memory_gb")
        assert metrics == expected
        assert_same_state(resumed.full_state(), after)

        export = str(tmp_path / "hf")
        resumed.export_hf(export)
        logprobs = resumed.forward_logprobs(samples)
    finally:
        resumed.shutdown()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(export))
    model = AutoModelForCausalLM.from_pretrained(export)
    assert AutoTokenizer.from_pretrained(export).chat_template  # the source's tokenizer
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, after["model"][name]), name
    if lora.rank:
        check_lora_state_and_adapter_export(tiny_model, lora, saved, after, export)
    sample = samples[0]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([sample.token_ids])).logits[0], dim=-1)
    expected_lp = logp[:-1].gather(1, torch.tensor(sample.token_ids[1:])[:, None])[:, 0]
    got = torch.tensor(logprobs[0][1:])
    mask = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
    torch.testing.assert_close(got[mask], expected_lp[mask], atol=1e-5, rtol=0)


def check_lora_state_and_adapter_export(tiny_model, lora, saved, after, export) -> None:
    from safetensors.torch import load_file

    base = load_file(f"{tiny_model}/model.safetensors")
    adapted = {k for k in saved["optim"]["state"]}
    assert adapted and all(".lora_A." in k or ".lora_B." in k for k in adapted)
    adapter = load_file(f"{export}_adapter/adapter_model.safetensors")
    config = json.loads(Path(f"{export}_adapter/adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (lora.rank, lora.alpha)
    assert {f"base_model.model.{k}" for k in adapted} == set(adapter)
    for name, tensor in after["model"].items():
        layer = name.removesuffix(".weight")
        if layer in config["target_modules"]:
            a = adapter[f"base_model.model.{layer}.lora_A.weight"]
            b = adapter[f"base_model.model.{layer}.lora_B.weight"]
            rebuilt = base[name] + lora.alpha / lora.rank * b @ a
            torch.testing.assert_close(tensor, rebuilt, atol=1e-6, rtol=0)
            assert not torch.equal(tensor, base[name])
        else:  # frozen
            assert torch.equal(tensor, base[name]), name


def test_hf_export_replaces_atomically(tiny_model, tmp_path):
    """An export is written beside its path and renamed in: one that crashes midway leaves
    the earlier export whole, and the next export cleans up after it."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from molt_train.checkpoint import write_hf_checkpoint

    config = AutoConfig.from_pretrained(tiny_model)
    weights = load_file(f"{tiny_model}/model.safetensors")
    out = tmp_path / "hf_policy"
    write_hf_checkpoint(str(out), weights.items(), config, tiny_model)

    def crashing():
        yield from list(weights.items())[:3]
        raise RuntimeError("killed mid-export")

    with pytest.raises(RuntimeError, match="mid-export"):
        write_hf_checkpoint(str(out), crashing(), config, tiny_model)
    assert load_file(str(out / "model.safetensors")).keys() == weights.keys()
    doubled = {k: 2 * v for k, v in weights.items()}
    write_hf_checkpoint(str(out), doubled.items(), config, tiny_model)
    assert not (tmp_path / "hf_policy.tmp").exists()
    name = next(iter(weights))
    assert torch.equal(load_file(str(out / "model.safetensors"))[name], 2 * weights[name])
