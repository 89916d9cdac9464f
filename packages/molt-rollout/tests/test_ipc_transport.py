"""Molt's CUDA-IPC backend, the parts that need no GPU: which models take new weights in
place, and the update message. The transfer itself runs on the H200:
tests_integration/gpu/test_colocated_refit.py and benchmarks/refit_ipc.py."""

from types import SimpleNamespace

import pytest
import torch

from molt_rollout.buckets import BucketMeta, iter_buckets, pack, packed_size, unpack

ipc_transport = pytest.importorskip("molt_rollout.ipc_transport")


def vllm_config(quantization=None, cache_dtype="auto"):
    return SimpleNamespace(model_config=SimpleNamespace(quantization=quantization),
                           cache_config=SimpleNamespace(cache_dtype=cache_dtype))  # fmt: skip


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
    tensors = [(f"t{i}", torch.randn(17 + i, 5, generator=gen).to(dtype))
               for i, dtype in enumerate([torch.bfloat16, torch.float32, torch.float16] * 3)]  # fmt: skip
    staging = torch.full((4096,), 255, dtype=torch.uint8)
    for meta, bucket in iter_buckets(iter(tensors), bucket_bytes=600):
        assert packed_size(bucket) == meta.numbytes() <= staging.numel()
        view = pack(bucket, out=staging)
        for (name, got), want in zip(unpack(view, meta), bucket, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want), name
    with pytest.raises(ValueError, match="do not fit"):
        pack([torch.zeros(2000)], out=staging)
