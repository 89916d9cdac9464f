"""Weight buckets: many (name, tensor) pairs as one flat byte buffer, and back.

The refit sender groups a model's tensors into buckets of about `bucket_bytes` and ships each
bucket as one transfer with one metadata record (names, dtypes, shapes), never one call per
tensor. Both ends of the CPU transport use these two functions, so they cannot disagree on
the layout: tensors back to back, each in its own dtype's bytes, in metadata order.
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class BucketMeta:
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)

    def numbytes(self) -> int:
        return sum(
            torch.Size(shape).numel() * getattr(torch, dtype).itemsize
            for dtype, shape in zip(self.dtype_names, self.shapes, strict=True)
        )


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[BucketMeta, list[torch.Tensor]]]:
    """Group tensors in order into buckets of at most `bucket_bytes` (a larger tensor travels
    alone)."""
    meta, tensors, size = BucketMeta(), [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if tensors and size + nbytes > bucket_bytes:
            yield meta, tensors
            meta, tensors, size = BucketMeta(), [], 0
        meta.names.append(name)
        meta.dtype_names.append(str(tensor.dtype).removeprefix("torch."))
        meta.shapes.append(list(tensor.shape))
        tensors.append(tensor)
        size += nbytes
    if tensors:
        yield meta, tensors


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat uint8 buffer holding the tensors' bytes back to back."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack(buffer: torch.Tensor, meta: BucketMeta) -> list[tuple[str, torch.Tensor]]:
    """The inverse of `pack`, as (name, tensor) views into `buffer`."""
    out, offset = [], 0
    for name, dtype_name, shape in zip(meta.names, meta.dtype_names, meta.shapes, strict=True):
        dtype = getattr(torch, dtype_name)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        out.append((name, buffer[offset : offset + nbytes].view(dtype).view(shape)))
        offset += nbytes
    if offset != buffer.numel():
        raise ValueError(f"bucket holds {buffer.numel()} bytes but its metadata {offset}")
    return out
