"""Per-sample ``gather`` and ``take_along_dim``: elements picked by an index ``Ragged``.

Each result element's source row is computed from the index values and the
sample's coordinates, then gathered (differentiable: the backward is an
``index_put``). Index values are checked to lie inside each sample's axis.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._axes import sample_axis
from .._errors import fail, shape_text
from .._index import coordinates
from .._nested import find_rows, row_coordinates
from .._ragged import Ragged, like
from .._validate import is_tracing
from ._broadcast import check_equal
from ._select import _require, _rows

__all__ = ["gather", "take_along_dim"]


def _check_bounds(fn: str, dim: int, idx: Tensor, limit: Tensor, segments: Tensor) -> None:
    """Index values must lie in ``[0, limit)``: eagerly one host read naming the first bad
    value; while tracing a device-side assertion (an out-of-range read must never happen)."""
    bad = (idx < 0) | (idx >= limit)
    if is_tracing(idx):
        torch._assert_async(
            ~bad.any(), f"{fn}: index values must lie in [0, size of axis {dim}) of each sample"
        )
        return
    if idx.numel() and bool(bad.any()):
        row = int(bad.reshape(bad.shape[0], -1).any(1).nonzero()[0, 0])
        value = int(idx[row][bad[row]].reshape(-1)[0])
        size = int(limit.reshape(limit.shape[0], -1)[row, 0])
        raise fail(
            fn,
            f"expected index values in [0, {size}) along axis {dim} of sample "
            f"{int(segments[row])}, got {value} (index values must lie in [0, size of axis {dim}) "
            "of each sample)",
        )


def _gather(fn: str, x: Ragged, dim: int, index: Ragged, broadcast: bool) -> Ragged:
    x = _require(fn, "x", x)
    index = _require(fn, "index", index)
    axis = sample_axis(x, dim, fn)
    if index.dtype != torch.int64:
        raise fail(fn, f"index must be an int64 Ragged value, got dtype {index.dtype}")
    if index.layout != x.layout or index.batch_size != x.batch_size:
        raise fail(
            fn,
            f"index must have the layout and batch size of x (logical shape {shape_text(x.shape)}), got "
            f"logical shape {shape_text(index.shape)}",
        )
    others = [j for j in range(x.num_ragged) if not (axis.ragged and j == axis.index)]
    if x.row_offsets:  # the levels above the axis (all of them along a dense axis) agree
        above = axis.index if axis.ragged else x.num_ragged
        others = list(range(above))
        explain = f"index must match x's nested ragged axes above axis {dim}"
        for k in range(max(above - 1, 0)):
            check_equal(fn, f"row_offsets[{k}]", index.row_offsets[k], x.row_offsets[k], explain)
    if others:
        check_equal(
            fn,
            "sizes",
            index.sizes[:, others],
            x.sizes[:, others],
            f"index must match x's ragged sizes except along axis {dim}",
        )
    x_dense = tuple(x.values.shape[1:])
    i_dense = list(index.values.shape[1:])
    for j, (si, sx) in enumerate(zip(i_dense, x_dense, strict=True)):
        if not axis.ragged and j == axis.index:
            continue
        if broadcast and si == 1:
            i_dense[j] = sx
        elif si != sx if broadcast else si > sx:
            raise fail(
                fn,
                f"index has size {si} along a dense axis where x has {sx} "
                f"(x {shape_text(x.shape)}, index {shape_text(index.shape)})",
            )
    idx = index.values.expand(index.values.shape[0], *i_dense)
    total = idx.shape[0]
    view = (-1, *[1] * len(i_dense))
    positions = []
    for j, size in enumerate(i_dense):
        shape = [1] * (1 + len(i_dense))
        shape[1 + j] = size
        positions.append(torch.arange(size, device=idx.device).view(shape))
    if x.row_offsets:
        segments, coords = row_coordinates(index.sizes, index.row_offsets, total)
        if axis.ragged:
            coords = [c.view(view) for c in coords]
            coords[axis.index] = idx
            row, found = find_rows(x.sizes, x.row_offsets, segments.view(view), coords)
            _check_found(fn, dim, idx, found, segments)
            row = row.clamp(0, max(x.values.shape[0] - 1, 0))
        else:
            limit = torch.full_like(segments, x_dense[axis.index]).view(view)
            _check_bounds(fn, dim, idx, limit, segments)
            row = torch.arange(total, device=idx.device).view(view)
            positions[axis.index] = idx
        return _take(x, index, row, positions, i_dense)
    segments, coords = coordinates(index.offsets, index.sizes, total)
    if axis.ragged:
        limit = x.sizes[segments, axis.index].view(-1, *[1] * len(i_dense))
    else:
        limit = torch.full_like(segments, x_dense[axis.index]).view(-1, *[1] * len(i_dense))
    _check_bounds(fn, dim, idx, limit, segments)
    if axis.ragged:
        coords = list(coords)
        coords = [c.view(view) for c in coords]
        coords[axis.index] = idx
        row = x.offsets[segments].view(view)
        stride = torch.ones_like(segments).view(view)
        for k in reversed(range(x.num_ragged)):
            row = row + coords[k] * stride
            stride = stride * x.sizes[segments, k].view(view)
    else:
        row = _rows(x, segments, coords).view(view)
        positions[axis.index] = idx
    return _take(x, index, row, positions, i_dense)


def _take(
    x: Ragged, index: Ragged, row: Tensor, positions: list[Tensor], i_dense: list[int]
) -> Ragged:
    """The elements of ``x`` at packed ``row`` and dense ``positions``, on ``index``'s
    partition."""
    flat = row
    for j, size in enumerate(x.values.shape[1:]):
        flat = flat * size + positions[j]
    values = x.values.reshape(-1)[flat.reshape(-1)].reshape(index.values.shape[0], *i_dense)
    return like(index, values)


def _check_found(fn: str, dim: int, idx: Tensor, found: Tensor, segments: Tensor) -> None:
    """Along a nested axis an index value must name an element of ``x`` that holds the
    index element's coordinates below the axis."""
    message = (
        f"index values must name an element along axis {dim} of each sample's x (one that "
        "has the index element's coordinates below that axis)"
    )
    if is_tracing(idx):
        torch._assert_async(found.all(), f"{fn}: {message}")
        return
    bad = ~found.expand(idx.shape)
    if idx.numel() and bool(bad.any()):
        row = int(bad.reshape(bad.shape[0], -1).any(1).nonzero()[0, 0])
        value = int(idx[row][bad[row]].reshape(-1)[0])
        raise fail(fn, f"{message}; got {value} in sample {int(segments[row])}")


def gather(x: Ragged, dim: int, index: Ragged) -> Ragged:
    """``torch.gather(x_i, dim, index_i)`` for each sample.

    Args:
        x: ``Ragged`` value.
        dim: logical axis to gather along (ragged or dense).
        index: int64 ``Ragged`` with the layout of ``x``; its ragged sizes equal
            those of ``x`` except along ``dim``, its dense sizes are at most
            those of ``x``. Values lie in ``[0, size of dim)`` in each sample.
            With nested ragged axes, along nested axis ``dim`` the axes above it
            must equal those of ``x`` (the axes below may differ), and every
            element takes ``x``'s element at its own coordinates with the one
            along ``dim`` replaced by its value (``out[i][s][t] =
            x[i][index[i][s][t]][t]``), which must exist; along a dense axis the
            partitions must be equal.

    Returns:
        ``Ragged`` with the partition of ``index``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value or ``index`` is not an int64 ``Ragged``
            with the layout and batch size of ``x``; its ragged sizes differ from those of
            ``x`` outside ``dim`` or a dense size exceeds that of ``x``; an index lies
            outside ``[0, size of dim)`` of its sample; ``dim`` out of range.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([5.0, 6.0, 7.0]), torch.tensor([8.0])])
        >>> i = raggedfn.from_list([torch.tensor([2, 0]), torch.tensor([0, 0, 0])])
        >>> raggedfn.gather(x, 1, i).values.tolist()
        [7.0, 5.0, 8.0, 8.0, 8.0]
    """
    return _gather("gather", x, dim, index, broadcast=False)


def take_along_dim(x: Ragged, indices: Ragged, dim: int) -> Ragged:
    """``torch.take_along_dim(x_i, indices_i, dim)`` for each sample.

    Like :func:`gather` (note the argument order), except that a dense axis of
    size 1 in ``indices`` broadcasts against ``x``; other dense sizes must be equal.

    Args:
        x: ``Ragged`` value.
        indices: int64 ``Ragged`` with the layout of ``x``.
        dim: logical axis to take along (ragged or dense).

    Returns:
        ``Ragged`` with the partition of ``indices``.

    Raises:
        RaggedError: as :func:`gather` (a dense axis of size 1 in ``indices`` broadcasts).

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([5.0, 6.0]), torch.tensor([8.0, 9.0])])
        >>> i = raggedfn.from_list([torch.tensor([1]), torch.tensor([0, 1])])
        >>> raggedfn.take_along_dim(x, i, 1).values.tolist()
        [6.0, 8.0, 9.0]
    """
    return _gather("take_along_dim", x, dim, indices, broadcast=True)
