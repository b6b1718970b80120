"""Index tensors derived from partitions: segment ids and per-axis coordinates.

Everything here has static output sizes (``output_size=T``), so it needs no
host sync and compiles without data-dependent shapes.
"""

from __future__ import annotations

import torch
from torch import Tensor


def lengths_of(offsets: Tensor) -> Tensor:
    """``[B]`` rows owned by each sample."""
    return offsets[1:] - offsets[:-1]


def offsets_of(lengths: Tensor) -> Tensor:
    """``[B + 1]`` offsets from ``[B]`` lengths (int64)."""
    zero = torch.zeros(1, dtype=torch.int64, device=lengths.device)
    return torch.cat([zero, torch.cumsum(lengths.to(torch.int64), 0)])


def segment_ids(offsets: Tensor, total: int) -> Tensor:
    """``[T]`` sample index of every packed row."""
    batch_size = offsets.shape[0] - 1
    ids = torch.arange(batch_size, device=offsets.device)
    return torch.repeat_interleave(ids, lengths_of(offsets), output_size=total)


def local_positions(offsets: Tensor, segments: Tensor, total: int) -> Tensor:
    """``[T]`` position of every packed row inside its sample."""
    return torch.arange(total, device=offsets.device) - offsets[segments]


def coordinates(offsets: Tensor, sizes: Tensor, total: int) -> tuple[Tensor, list[Tensor]]:
    """Sample index and the coordinate along each ragged axis, for every packed row.

    Returns ``(segments [T], [coord_0 [T], ..., coord_{R-1} [T]])`` where the
    ragged axes are stored row-major in ``k`` order.
    """
    segments = segment_ids(offsets, total)
    rest = local_positions(offsets, segments, total)
    num_ragged = sizes.shape[1]
    coords: list[Tensor] = [rest] * num_ragged
    for k in range(num_ragged - 1, 0, -1):
        size_k = sizes[segments, k]
        coords[k] = torch.remainder(rest, size_k)
        rest = torch.div(rest, size_k, rounding_mode="floor")
    if num_ragged:
        coords[0] = rest
    return segments, coords
