"""Weight buckets: grouping by size, and the flat byte layout both transport ends share."""

import json
import random
from dataclasses import asdict

import pytest
import torch

from molt_rollout.refit.buckets import BucketMeta, iter_buckets, pack, packed_size, unpack

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bit pattern (so NaN payloads, -0.0 and bfloat16 compare exactly)."""
    t = t.contiguous()
    return t.view(_SAME_SIZE_INT[t.element_size()]) if t.is_floating_point() else t


def assert_bit_exact(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]):
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, g), (_, w) in zip(got, want, strict=True):
        assert g.dtype == w.dtype, name
        assert g.shape == w.shape, name
        assert torch.equal(bits(g), bits(w)), name


def special_floats(dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-30, -3.5], dtype=dtype
    )


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    """Every dtype, 0-dim scalars, empty tensors, a non-contiguous view; wider dtypes first, so
    every tensor starts at an offset that is a multiple of its element size."""
    g = torch.Generator().manual_seed(0)
    return [
        ("ids", torch.randint(-(2**62), 2**62, (3, 5), generator=g, dtype=torch.int64)),
        ("step", torch.tensor(-12345678901234, dtype=torch.int64)),
        ("no_ids", torch.empty(0, dtype=torch.int64)),
        ("w32", torch.randn(7, 3, generator=g)),
        ("w32_t", torch.randn(4, 6, generator=g).t()),  # non-contiguous
        ("s32", torch.tensor(3.25)),
        ("x32", special_floats(torch.float32)),
        ("e32", torch.empty(2, 0, 3)),
        ("wbf16", torch.randn(5, 3, generator=g).to(torch.bfloat16)),
        ("xbf16", special_floats(torch.bfloat16)),
        ("sbf16", torch.tensor(-1.5, dtype=torch.bfloat16)),
        ("w16", torch.randn(3, 3, generator=g).to(torch.float16)),
        ("x16", special_floats(torch.float16)),
        ("e16", torch.empty(0, 4, dtype=torch.float16)),
        ("s16", torch.tensor(0.1, dtype=torch.float16)),
    ]


def one_bucket(named: list[tuple[str, torch.Tensor]]) -> tuple[BucketMeta, list[torch.Tensor]]:
    buckets = list(iter_buckets(named, bucket_bytes=1 << 30))
    assert len(buckets) == 1
    return buckets[0]


# --- pack / unpack --------------------------------------------------------------------------


def test_round_trip_mixed_dtypes_and_shapes_bit_exact():
    named = mixed_tensors()
    meta, tensors = one_bucket(named)
    buffer = pack(tensors)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    assert buffer.numel() == meta.numbytes()
    assert_bit_exact(unpack(buffer, meta), named)


def test_meta_records_names_dtypes_and_shapes():
    named = mixed_tensors()
    meta, tensors = one_bucket(named)
    assert meta.names == [n for n, _ in named]
    assert meta.dtype_names[:4] == ["int64", "int64", "int64", "float32"]
    assert "bfloat16" in meta.dtype_names and "float16" in meta.dtype_names
    assert meta.shapes[meta.names.index("step")] == []
    assert meta.shapes[meta.names.index("w32_t")] == [6, 4]
    assert meta.shapes == [list(t.shape) for _, t in named]
    assert all(a is b for a, (_, b) in zip(tensors, named, strict=True))


def test_layout_is_tensors_in_order_at_aligned_offsets():
    a = torch.tensor([1], dtype=torch.int16)
    b = torch.tensor([1.0], dtype=torch.float32)
    buffer = pack([a, b])
    # a's 2 bytes, zero padding to the 16-byte boundary, b's 4 bytes, padding to 32.
    expected = list(a.numpy().tobytes()) + [0] * 14 + list(b.numpy().tobytes()) + [0] * 12
    assert buffer.tolist() == expected


def test_numbytes_matches_packed_size_per_bucket():
    named = mixed_tensors()
    for bucket_bytes in (1, 16, 64, 200, 1 << 20):
        for meta, tensors in iter_buckets(named, bucket_bytes):
            assert meta.numbytes() == pack(tensors).numel()


def test_numbytes_known_values():
    meta = BucketMeta(
        names=["a", "b", "c", "d"],
        dtype_names=["float32", "bfloat16", "int64", "float16"],
        shapes=[[2, 3], [], [0, 5], [7]],
    )
    # 24 bytes -> 32; 2 bytes at 32 -> 48; 0 bytes at 48; 14 bytes at 48 -> 64.
    assert meta.layout() == [(0, 24), (32, 2), (48, 0), (48, 14)]
    assert meta.numbytes() == 64
    assert BucketMeta().numbytes() == 0


def test_meta_survives_the_json_wire():
    """The refit sends `asdict(meta)` as JSON; the receiver rebuilds it and unpacks."""
    named = mixed_tensors()
    meta, tensors = one_bucket(named)
    received = BucketMeta(**json.loads(json.dumps(asdict(meta))))
    assert received == meta
    assert_bit_exact(unpack(pack(tensors).clone(), received), named)


def test_unpack_returns_views_into_the_buffer():
    a, b = torch.arange(4, dtype=torch.int64), torch.ones(2, dtype=torch.float32)
    meta, tensors = one_bucket([("a", a), ("b", b)])
    buffer = pack(tensors)
    (_, ua), (_, ub) = unpack(buffer, meta)
    buffer.zero_()
    assert ua.tolist() == [0, 0, 0, 0] and ub.tolist() == [0.0, 0.0]


def test_unpack_rejects_a_longer_buffer():
    named = mixed_tensors()
    meta, tensors = one_bucket(named)
    buffer = pack(tensors)
    for extra in (1, 8):
        longer = torch.cat([buffer, torch.zeros(extra, dtype=torch.uint8)])
        with pytest.raises(ValueError, match="metadata"):
            unpack(longer, meta)


def test_unpack_rejects_metadata_that_disagrees_with_the_buffer():
    meta, tensors = one_bucket([("a", torch.ones(4)), ("b", torch.ones(2))])
    buffer = pack(tensors)
    wrong = BucketMeta(names=["a"], dtype_names=["float32"], shapes=[[4]])  # "b" missing
    with pytest.raises(ValueError):
        unpack(buffer, wrong)


def test_unpack_rejects_a_shorter_buffer_with_value_error():
    meta, tensors = one_bucket([("a", torch.ones(4)), ("b", torch.ones(2))])
    with pytest.raises(ValueError):
        unpack(pack(tensors)[:-4], meta)


def test_round_trip_unaligned_offsets():
    named = [
        ("half", torch.tensor(1.5, dtype=torch.float16)),  # 2 bytes, then a float32
        ("w", torch.randn(3)),
        ("bf", torch.randn(3).to(torch.bfloat16)),  # 6 bytes, then an int64
        ("step", torch.tensor(5, dtype=torch.int64)),
    ]
    meta, tensors = one_bucket(named)
    assert_bit_exact(unpack(pack(tensors), meta), named)


# --- iter_buckets ---------------------------------------------------------------------------


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def check_buckets(named, bucket_bytes):
    buckets = list(iter_buckets(iter(named), bucket_bytes))
    flat = [name for meta, _ in buckets for name in meta.names]
    assert flat == [n for n, _ in named]  # every tensor once, in order
    for i, (meta, tensors) in enumerate(buckets):
        assert tensors, "empty bucket"
        assert len(meta.names) == len(meta.dtype_names) == len(meta.shapes) == len(tensors)
        size = sum(nbytes(t) for t in tensors)
        assert size <= bucket_bytes or len(tensors) == 1, (i, size, bucket_bytes)
        if i + 1 < len(buckets):  # greedy: the next bucket's first tensor did not fit here
            assert size + nbytes(buckets[i + 1][1][0]) > bucket_bytes
    return buckets


@pytest.mark.parametrize("seed", range(20))
def test_buckets_respect_size_keep_order_and_are_greedy(seed):
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
    named = []
    for i in range(rng.randint(1, 30)):
        shape = [rng.choice([0, 1, 2, 3, 8, 33]) for _ in range(rng.randint(0, 2))]
        named.append((f"t{i}", torch.zeros(shape, dtype=rng.choice(dtypes))))
    buckets = check_buckets(named, bucket_bytes=rng.choice([1, 8, 50, 128, 1000]))
    names = dict(named)
    for meta, tensors in buckets:
        assert all(names[n] is t for n, t in zip(meta.names, tensors, strict=True))


def test_exact_fit_stays_together_one_more_byte_splits():
    a, b = torch.zeros(2, dtype=torch.float32), torch.zeros(2, dtype=torch.float32)  # 8 B each
    assert [m.names for m, _ in iter_buckets([("a", a), ("b", b)], 16)] == [["a", "b"]]
    assert [m.names for m, _ in iter_buckets([("a", a), ("b", b)], 15)] == [["a"], ["b"]]


def test_oversized_tensor_travels_alone():
    small, big = torch.zeros(2), torch.zeros(100)  # 8 B and 400 B
    named = [("s1", small), ("s2", small), ("big", big), ("s3", small), ("big2", big)]
    buckets = check_buckets(named, bucket_bytes=20)
    assert [m.names for m, _ in buckets] == [["s1", "s2"], ["big"], ["s3"], ["big2"]]


def test_no_tensors_no_buckets():
    assert list(iter_buckets([], 1 << 20)) == []
    assert list(iter_buckets(iter(()), 1)) == []


def test_zero_byte_tensors_still_travel():
    named = [("e1", torch.empty(0)), ("e2", torch.empty(3, 0, dtype=torch.bfloat16))]
    buckets = check_buckets(named, bucket_bytes=1)
    assert [m.names for m, _ in buckets] == [["e1", "e2"]]
    meta, tensors = buckets[0]
    assert meta.numbytes() == 0
    assert_bit_exact(unpack(pack(tensors), meta), named)


def test_state_dict_through_buckets_round_trips():
    """What a refit does: a module's state dict in buckets, packed, unpacked, loaded back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 3)
    )
    state = list(model.state_dict().items())
    received = []
    buckets = list(iter_buckets(state, bucket_bytes=1024))
    assert len(buckets) > 1
    for meta, tensors in buckets:
        wire = pack(tensors).clone()  # what the receiver's broadcast buffer would hold
        received += [(n, t.clone()) for n, t in unpack(wire, meta)]
    assert_bit_exact(received, state)
    clone = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 3)
    )
    clone.load_state_dict(dict(received))
    x = torch.randn(4, 16)
    assert torch.equal(clone(x), model(x))


def test_a_wire_dtype_casts_while_packing():
    """The refit sends fp32 master weights as bf16: sized, described and packed as bf16, each
    value what `.to(bfloat16)` gives."""
    gen = torch.Generator().manual_seed(0)
    named = [(f"w{i}", torch.randn(5 + i, 3, generator=gen)) for i in range(4)]
    buckets = list(iter_buckets(named, bucket_bytes=2 * 6 * 3 * 2, dtype=torch.bfloat16))
    assert [m.names for m, _ in buckets] == [["w0", "w1"], ["w2"], ["w3"]]
    for meta, tensors in buckets:
        assert set(meta.dtype_names) == {"bfloat16"}
        buffer = pack(tensors, dtype=torch.bfloat16)
        assert buffer.numel() == meta.numbytes() == packed_size(tensors, torch.bfloat16)
        for (name, got), want in zip(unpack(buffer, meta), tensors, strict=True):
            assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16)), name
