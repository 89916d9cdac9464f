"""Weight buckets: many (name, tensor) pairs as one flat byte buffer and back, so a refit makes
one transfer per bucket, not per tensor. Each tensor lies in its wire dtype at a multiple of
ALIGN bytes, so the receiver views it in place."""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

ALIGN = 16  # bytes; a multiple of every dtype's item size


def _layout(sizes: list[int]) -> tuple[list[tuple[int, int]], int]:
    """Each tensor's (offset, nbytes), at multiples of ALIGN, and the bytes of them all."""
    layout, end = [], 0
    for nbytes in sizes:
        layout.append((end, nbytes))
        end = -(-(end + nbytes) // ALIGN) * ALIGN
    return layout, end


@dataclass
class BucketMeta:
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)

    def layout(self) -> list[tuple[int, int]]:
        """(offset, nbytes) of each tensor in the packed buffer."""
        return self._packed()[0]

    def numbytes(self) -> int:
        return self._packed()[1]

    def _packed(self) -> tuple[list[tuple[int, int]], int]:
        pairs = zip(self.dtype_names, self.shapes, strict=True)
        return _layout([torch.Size(s).numel() * getattr(torch, d).itemsize for d, s in pairs])


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[BucketMeta, list[torch.Tensor]]]:
    """Group tensors in order into buckets of at most `bucket_bytes` (a larger tensor travels
    alone), sized and described in `dtype` (the tensors' own if None)."""
    meta, tensors, size = BucketMeta(), [], 0
    for name, tensor in named_tensors:
        wire = dtype or tensor.dtype
        nbytes = tensor.numel() * wire.itemsize
        if tensors and size + nbytes > bucket_bytes:
            yield meta, tensors
            meta, tensors, size = BucketMeta(), [], 0
        meta.names.append(name)
        meta.dtype_names.append(str(wire).removeprefix("torch."))
        meta.shapes.append(list(tensor.shape))
        tensors.append(tensor)
        size += nbytes
    if tensors:
        yield meta, tensors


def _tensor_layout(tensors: list[torch.Tensor], dtype: torch.dtype | None):
    return _layout([t.numel() * (dtype or t.dtype).itemsize for t in tensors])


def packed_size(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> int:
    return _tensor_layout(tensors, dtype)[1]


def pack(
    tensors: list[torch.Tensor], out: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """One flat uint8 buffer of the tensors' bytes at their offsets, cast to `dtype` in the
    copy: a new one, or the head of `out` (at least `packed_size` bytes, reused)."""
    layout, size = _tensor_layout(tensors, dtype)
    if out is None:
        out = torch.zeros(size, dtype=torch.uint8, device=tensors[0].device)
    elif out.numel() < size:
        raise ValueError(f"{size} bytes do not fit a buffer of {out.numel()}")
    # Typed views, not bytes: the copy moves whole elements, faster than bytes, and casts on
    # the way (docs/performance.md).
    views = [
        out[o : o + n].view(dtype or t.dtype) for (o, n), t in zip(layout, tensors, strict=True)
    ]
    flat = [t.detach().reshape(-1) for t in tensors]
    torch._foreach_copy_(views, flat)  # one launch for the bucket, not one per tensor
    return out[:size]


def unpack(buffer: torch.Tensor, meta: BucketMeta) -> list[tuple[str, torch.Tensor]]:
    """The inverse of `pack`, as (name, tensor) views into `buffer`."""
    if buffer.numel() != meta.numbytes():
        raise ValueError(f"bucket holds {buffer.numel()} bytes but its metadata {meta.numbytes()}")
    fields = zip(meta.names, meta.dtype_names, meta.shapes, meta.layout(), strict=True)
    return [
        (name, buffer[offset : offset + n].view(getattr(torch, dtype)).view(shape))
        for name, dtype, shape, (offset, n) in fields
    ]
