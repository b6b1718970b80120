"""Softmax and log-softmax along any logical axis of a ``Ragged`` value.

Along a dense axis this is torch's op on ``values``. Along a ragged axis the
rows are normalised within their line (the rows of a sample that differ only
along that axis) by a segment primitive; an empty sample stays empty.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .._axes import normalize_axis
from .._errors import fail
from .._index import line_starts, segment_bounds, segment_ids
from .._nested import reduced_levels
from .._prims import segment_log_softmax, segment_softmax
from .._ragged import Ragged
from ._reduce_plan import require_ragged, static_axes

__all__ = ["log_softmax", "softmax"]


def line_segments(x: Ragged, axis: int) -> tuple[Tensor, int]:
    """``(segments [T], num_segments)`` grouping the rows of each line along ragged ``axis``.

    One ragged axis: the segment is the sample. Several: the line's first
    packed row, so no host sync is needed (``num_segments = T``). Nested axes:
    the element of the axis above (for the innermost axis), or the aligned
    positions below an outer axis (``num_segments`` an upper bound, no sync).
    """
    total = x.values.shape[0]
    if x.row_offsets:  # lines along a nested axis: the rows under one element above it
        segments, num, _ = reduced_levels(x.sizes, x.row_offsets, total, (axis,), exact=False)
        return segments, num
    if x.layout.num_ragged == 1:
        return segment_ids(x.offsets, total), x.batch_size
    starts, _ = line_starts(x.offsets, x.sizes, total, axis)
    return starts, total


def _normalise(
    fn: str,
    x: Ragged,
    dim: int,
    dtype: torch.dtype | None,
    dense: Callable[..., Tensor],
    prim: Callable[[Tensor, Tensor, int], Tensor],
) -> Ragged:
    x = require_ragged(x, fn)
    ragged, index = _sample_axis(x, dim, fn)
    values = x.values if dtype is None else x.values.to(dtype)
    if not values.is_floating_point():
        raise fail(fn, f"x must have a floating point dtype (or pass dtype=), got {values.dtype}")
    if not ragged:
        out = dense(values, 1 + index)
    elif prim is segment_softmax and _sorted_samples(x):
        # the segments are the samples, in order: their bounds let small CPU inputs take
        # torch.segment_reduce (remembered with the segment ids, eagerly)
        segments, bounds = segment_bounds(x.offsets, x.values.shape[0])
        out = segment_softmax(values, segments, x.batch_size, bounds)
    else:
        segments, num_segments = line_segments(x, index)
        out = prim(values, segments, num_segments)
    # values of x's own shape, device and partition: valid by construction (no re-check)
    return Ragged._make(out, x.offsets, x.sizes, x.layout, x.row_offsets)


def _sorted_samples(x: Ragged) -> bool:
    """One plain ragged axis on the CPU, eagerly: the lines are the samples."""
    return (
        x.layout.num_ragged == 1
        and not x.row_offsets
        and x.values.device.type == "cpu"
        and not torch.compiler.is_compiling()
    )


def _sample_axis(x: Ragged, dim: int, fn: str) -> tuple[bool, int]:
    """``(ragged, index)`` of logical axis ``dim``; remembered eagerly per (layout code, dim)
    for a plain int (a bad ``dim`` raises before anything is stored)."""
    if type(dim) is not int or torch.compiler.is_compiling():
        return static_axes(x.layout)[normalize_axis(x, dim, fn, allow_batch=False) - 1]
    key = (x.layout.code, dim)
    found = _SAMPLE_AXES.get(key)
    if found is None:
        axis = normalize_axis(x, dim, fn, allow_batch=False)
        found = _SAMPLE_AXES[key] = static_axes(x.layout)[axis - 1]
    return found


# eager answers of _sample_axis, by (layout code, dim)
_SAMPLE_AXES: dict[tuple[str, int], tuple[bool, int]] = {}


def softmax(x: Ragged, dim: int, *, dtype: torch.dtype | None = None) -> Ragged:
    """Softmax along one logical axis (not the batch axis).

    Args:
        x: a floating point ``Ragged`` value.
        dim: the logical axis to normalise along (ragged or dense).
        dtype: cast ``values`` to this dtype first.

    Returns:
        A ``Ragged`` with the partition of ``x``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``dim`` is not an int or is out of
            range for the logical shape of ``x``, or is the batch axis; the values (after
            ``dtype``) are not floating point.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.zeros(2), torch.zeros(0), torch.zeros(1)])
        >>> raggedfn.softmax(x, 1).values
        tensor([0.5000, 0.5000, 1.0000])
    """
    return _normalise("softmax", x, dim, dtype, torch.softmax, segment_softmax)


def log_softmax(x: Ragged, dim: int, *, dtype: torch.dtype | None = None) -> Ragged:
    """Log-softmax along one logical axis (not the batch axis); see :func:`softmax`.

    Args:
        x: a floating point ``Ragged`` value.
        dim: the logical axis to normalise along (ragged or dense).
        dtype: cast ``values`` to this dtype first.

    Returns:
        A ``Ragged`` with the partition of ``x``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``dim`` is not an int or is out of
            range for the logical shape of ``x``, or is the batch axis; the values (after
            ``dtype``) are not floating point.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.zeros(2), torch.zeros(1)])
        >>> raggedfn.log_softmax(x, 1).values
        tensor([-0.6931, -0.6931,  0.0000])
    """
    return _normalise("log_softmax", x, dim, dtype, torch.log_softmax, segment_log_softmax)
