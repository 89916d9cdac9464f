"""Molt's CUDA-IPC backend, the parts that need no GPU: which models take new weights in
place, and the update message. The transfer itself runs on a GPU:
tests_integration/gpu/test_colocated_refit.py and benchmarks/refit_vs_vllm.py."""

from types import SimpleNamespace

import pytest
import torch

from molt_rollout.refit.buckets import BucketMeta, iter_buckets, pack, packed_size, unpack

ipc_transport = pytest.importorskip("molt_rollout.refit.ipc_transport")


def vllm_config(quantization=None, cache_dtype="auto"):
    return SimpleNamespace(
        model_config=SimpleNamespace(quantization=quantization),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
    )


class FusedMoE(torch.nn.Module):  # named as vLLM's: the check goes by class name
    pass


class SharedFusedMoE(FusedMoE):
    pass


class MLAAttention(torch.nn.Module):
    pass


def test_a_dense_unquantized_model_loads_in_place():
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
    assert ipc_transport.loads_in_place(model, vllm_config())


@pytest.mark.parametrize("layer", [FusedMoE, SharedFusedMoE, MLAAttention])
def test_layers_processed_after_loading_take_the_layerwise_reload(layer):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), layer())
    assert not ipc_transport.loads_in_place(model, vllm_config())


@pytest.mark.parametrize(
    "config", [vllm_config(quantization="fp8"), vllm_config(cache_dtype="fp8")]
)
def test_quantized_weights_or_kv_cache_take_the_layerwise_reload(config):
    assert not ipc_transport.loads_in_place(torch.nn.Linear(4, 4), config)


def test_an_update_names_the_buffer_after_the_bucket_layout():
    meta = BucketMeta(names=["w"], dtype_names=["bfloat16"], shapes=[[2, 3]])
    info = ipc_transport.BufferUpdateInfo(**vars(meta), buffer={"handle": "h"})
    assert info.numbytes() == meta.numbytes() and info.buffer == {"handle": "h"}


def test_buckets_packed_into_one_reused_buffer_unpack_exactly():
    """The trainer's staging buffer holds one bucket after another."""
    gen = torch.Generator().manual_seed(0)
    tensors = [
        (f"t{i}", torch.randn(17 + i, 5, generator=gen).to(dtype))
        for i, dtype in enumerate([torch.bfloat16, torch.float32, torch.float16] * 3)
    ]
    staging = torch.full((4096,), 255, dtype=torch.uint8)
    for meta, bucket in iter_buckets(iter(tensors), bucket_bytes=600):
        assert packed_size(bucket) == meta.numbytes() <= staging.numel()
        view = pack(bucket, out=staging)
        for (name, got), want in zip(unpack(view, meta), bucket, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want), name
    with pytest.raises(ValueError, match="do not fit"):
        pack([torch.zeros(2000)], out=staging)


class Model(torch.nn.Module):
    """Records what the engine loads (vLLM's models take `load_weights(iterable)`)."""

    def __init__(self, *layers: torch.nn.Module) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights) -> None:
        self.loaded += list(weights)


@pytest.fixture
def engine(monkeypatch):
    """The engine side on CPU: the trainer's buffer 'mapped' from a dict of host tensors, and
    vLLM's own IPC engine's methods recorded instead of run (they need CUDA and a real model)."""
    calls: list[str] = []
    buffers: dict[str, torch.Tensor] = {}
    monkeypatch.setattr(
        ipc_transport, "open_shared", lambda fields, device: buffers[fields["handle"]]
    )
    parent = ipc_transport.IPCWeightTransferEngine
    for name in ("start_weight_update", "finish_weight_update", "receive_weights"):
        monkeypatch.setattr(parent, name, lambda self, *a, name=name: calls.append(name))

    def make(model: Model):
        config = SimpleNamespace(parallel_config=None, **vars(vllm_config()))
        return ipc_transport.BufferIpcEngine(None, config, torch.device("cpu"), model)

    return make, calls, buffers


def update(tensors: dict[str, torch.Tensor], buffers: dict, handle: str, slot: int = 0) -> dict:
    """What the trainer sends: the bucket packed into a buffer, named by handle and slot."""
    ((meta, bucket),) = iter_buckets(iter(tensors.items()), bucket_bytes=1 << 20)
    buffers.setdefault(handle, torch.zeros(4096, dtype=torch.uint8))
    pack(bucket, out=buffers[handle])
    return {**vars(meta), "buffer": {"handle": handle, "slot": slot}}


def test_a_dense_model_loads_views_of_the_buffer_without_the_layerwise_reload(engine):
    make, calls, buffers = engine
    model = Model(torch.nn.Linear(2, 2))
    eng = make(model)
    weights = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    eng.start_weight_update()
    eng.receive_weights(eng.parse_update_info(update(weights, buffers, "h1")))
    eng.finish_weight_update()
    assert calls == []  # no layerwise reload: start and finish did nothing of vLLM's
    assert [n for n, _ in model.loaded] == ["a", "b"]
    for name, tensor in model.loaded:
        assert torch.equal(tensor, weights[name])
        assert tensor.untyped_storage().data_ptr() == buffers["h1"].untyped_storage().data_ptr()
    eng.start_weight_update()  # the next refit: the same buffer stays mapped
    eng.receive_weights(eng.parse_update_info(update(weights, buffers, "h1")))
    assert eng.staging == {0: ("h1", buffers["h1"])}
    eng.receive_weights(eng.parse_update_info(update(weights, buffers, "h2", slot=1)))
    assert eng.staging == {0: ("h1", buffers["h1"]), 1: ("h2", buffers["h2"])}
    eng.receive_weights(eng.parse_update_info(update(weights, buffers, "h3")))  # slot 0 grew
    assert eng.staging == {0: ("h3", buffers["h3"]), 1: ("h2", buffers["h2"])}


def test_a_moe_model_takes_copies_through_the_layerwise_reload(engine):
    make, calls, buffers = engine
    model = Model(torch.nn.Linear(2, 2), SharedFusedMoE())
    eng = make(model)
    eng.start_weight_update()
    eng.receive_weights(eng.parse_update_info(update({"w": torch.ones(3)}, buffers, "h")))
    eng.finish_weight_update()
    assert calls == ["start_weight_update", "finish_weight_update"]
    ((_, tensor),) = model.loaded
    assert tensor.untyped_storage().data_ptr() != buffers["h"].untyped_storage().data_ptr()


def test_vllms_own_ipc_message_takes_vllms_path(engine):
    make, calls, _ = engine
    eng = make(Model(torch.nn.Linear(2, 2)))
    eng.start_weight_update()
    eng.receive_weights(SimpleNamespace(names=["w"]))  # not a BufferUpdateInfo: vLLM's message
    eng.finish_weight_update()
    assert calls == ["start_weight_update", "receive_weights", "finish_weight_update"]


class FusedModel(torch.nn.Module):
    """A loader like vLLM's: q, k and v go into slices of one fused parameter (narrow, then
    copy), `head` straight into its own. `extra` adds one more step after the copies."""

    def __init__(self, extra=None) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 2), requires_grad=False)
        self.head = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16), requires_grad=False)
        self.extra, self.calls = extra, 0

    def load_weights(self, weights) -> None:
        self.calls += 1
        rows = {"q": 0, "k": 2, "v": 4}
        with torch.no_grad():
            for name, tensor in weights:
                if name in rows:
                    self.qkv.data.narrow(0, rows[name], 2).copy_(tensor)
                else:
                    self.head.data.copy_(tensor)
            if self.extra is not None:
                self.extra(self)


def fused_weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights = {n: torch.randn(2, 2, generator=gen) for n in "qkv"}
    return {**weights, "head": torch.randn(2, 3, generator=gen).bfloat16()}


def assert_loaded(model: FusedModel, weights: dict) -> None:
    assert torch.equal(model.qkv, torch.cat([weights[n] for n in "qkv"]))
    assert torch.equal(model.head, weights["head"])


def test_later_refits_replay_the_loaders_copies(engine):
    make, calls, buffers = engine
    model = FusedModel()
    eng = make(model)
    for seed in range(3):  # the first refit runs the loader, the next ones replay its copies
        weights = fused_weights(seed)
        eng.start_weight_update()
        eng.receive_weights(eng.parse_update_info(update(weights, buffers, "h")))
        eng.finish_weight_update()
        assert_loaded(model, weights)
        assert model.calls == 1
    weights = fused_weights(3)  # the trainer grew its buffer: the loader runs again, once
    eng.receive_weights(eng.parse_update_info(update(weights, buffers, "h2")))
    assert_loaded(model, weights)
    assert model.calls == 2
    assert calls == []


def test_each_slot_keeps_its_own_replay(engine):
    """The trainer's two buffers in turn: a layout's copies are recorded once per slot (its
    sources are views of that slot's buffer), and a slot replaced keeps the other's plans."""
    make, _, buffers = engine
    model = FusedModel()
    eng = make(model)
    for seed, (handle, slot, calls) in enumerate(
        [("a", 0, 1), ("b", 1, 2), ("a", 0, 2), ("b", 1, 2), ("c", 1, 3), ("a", 0, 3)]
    ):
        weights = fused_weights(seed)
        eng.receive_weights(eng.parse_update_info(update(weights, buffers, handle, slot)))
        assert_loaded(model, weights)
        assert model.calls == calls, (handle, slot)


def double_head(model):
    model.head.data.copy_(model.head * 2)  # a copy of a computed tensor


def zero_first_row(model):
    model.qkv.data[0].fill_(0)  # an in-place op besides the copies (as zeroing a padding)


def rebind_head(model):
    model.head.data = model.head.data.clone()  # no op for the recorder to see


@pytest.mark.parametrize("extra", [double_head, zero_first_row, rebind_head])
def test_a_loader_that_does_more_than_copy_runs_every_time(engine, extra):
    make, _, buffers = engine
    model, reference = FusedModel(extra), FusedModel(extra)
    eng = make(model)
    for seed in range(2):
        weights = fused_weights(seed)
        eng.start_weight_update()
        eng.receive_weights(eng.parse_update_info(update(weights, buffers, "h")))
        eng.finish_weight_update()
        reference.load_weights(list(weights.items()))
        assert torch.equal(model.qkv, reference.qkv) and torch.equal(model.head, reference.head)
    assert model.calls == 2
