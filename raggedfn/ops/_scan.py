"""Cumulative sums along any logical axis of a ``Ragged`` value."""

from __future__ import annotations

import torch
from torch import Tensor

from .._axes import normalize_axis
from .._index import line_major_rows, line_starts, segment_ids
from .._prims import segment_cumsum, take_rows
from .._ragged import Ragged
from ._reduce_plan import require_ragged, static_axes
from ._softmax import line_segments

__all__ = ["cumsum"]


def cumsum(x: Ragged, dim: int, *, dtype: torch.dtype | None = None) -> Ragged:
    """Inclusive cumulative sum along one logical axis (not the batch axis).

    Along a ragged axis the running sum restarts in every sample (and, with
    several ragged axes, in every line along ``dim``). Integers and bool sum
    as int64, like ``torch.cumsum``.

    Args:
        x: a ``Ragged`` value.
        dim: the logical axis to accumulate along (ragged or dense).
        dtype: cast ``values`` to this dtype first.

    Returns:
        A ``Ragged`` with the partition of ``x``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``dim`` is not an int or is out of
            range for the logical shape of ``x``, or is the batch axis.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])])
        >>> raggedfn.cumsum(x, 1).values
        tensor([ 1.,  3.,  3.,  7., 12.])
    """
    x = require_ragged(x, "cumsum")
    ragged, index = static_axes(x.layout)[normalize_axis(x, dim, "cumsum", allow_batch=False) - 1]
    values = x.values if dtype is None else x.values.to(dtype)
    if not ragged:
        return x.with_values(torch.cumsum(values, 1 + index))
    total = values.shape[0]
    if x.row_offsets:
        return x.with_values(_nested_cumsum(x, values, index))
    if x.layout.num_ragged == 1:
        starts = x.offsets.index_select(0, segment_ids(x.offsets, total))
        return x.with_values(segment_cumsum(values, starts))
    starts, positions = line_starts(x.offsets, x.sizes, total, index)
    if index == x.layout.num_ragged - 1:
        return x.with_values(segment_cumsum(values, starts))
    # Move the axis innermost so that each line is contiguous, accumulate, move back.
    destination = line_major_rows(x.offsets, x.sizes, total, index)
    rows = torch.arange(total, device=values.device)
    source = torch.zeros_like(rows).index_copy(0, destination, rows)
    moved_starts = torch.zeros_like(rows).index_copy(0, destination, destination - positions)
    moved = segment_cumsum(take_rows(values, source), moved_starts)
    return x.with_values(take_rows(moved, destination))


def _nested_cumsum(x: Ragged, values: Tensor, axis: int) -> Tensor:
    """Running sums along nested axis ``axis``: within each element of the axis above
    (innermost axis: consecutive rows), or along aligned positions (outer axes:
    the lines are gathered together by a stable sort, accumulated and put back)."""
    total = values.shape[0]
    lines, _ = line_segments(x, axis)
    rows = torch.arange(total, device=values.device)
    if axis == x.num_ragged - 1:  # each line is the consecutive rows of one element
        starts = x.row_offsets[-1].index_select(0, lines)
        return segment_cumsum(values, starts)
    order = torch.sort(lines, stable=True).indices  # lines together, in packed order
    grouped = lines.index_select(0, order)
    first = torch.ones_like(grouped, dtype=torch.bool)
    first[1:] = grouped[1:] != grouped[:-1]
    starts = torch.cummax(torch.where(first, rows, torch.zeros_like(rows)), 0).values
    moved = segment_cumsum(take_rows(values, order), starts)
    inverse = torch.empty_like(order).scatter_(0, order, rows)
    return take_rows(moved, inverse)
