"""Per-sample ``gather`` and ``take_along_dim``: elements picked by an index ``Ragged``.

Each result element's source row is computed from the index values and the
sample's coordinates, then gathered (differentiable: the backward is an
``index_put``). Index values are checked to lie inside each sample's axis.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._axes import refuse_nested, sample_axis
from .._errors import fail, shape_text
from .._index import coordinates
from .._ragged import Ragged
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
    refuse_nested(fn, x)
    refuse_nested(fn, index)
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
    segments, coords = coordinates(index.offsets, index.sizes, total)
    if axis.ragged:
        limit = x.sizes[segments, axis.index].view(-1, *[1] * len(i_dense))
    else:
        limit = torch.full_like(segments, x_dense[axis.index]).view(-1, *[1] * len(i_dense))
    _check_bounds(fn, dim, idx, limit, segments)
    view = (-1, *[1] * len(i_dense))
    positions = []
    for j, size in enumerate(i_dense):
        shape = [1] * (1 + len(i_dense))
        shape[1 + j] = size
        positions.append(torch.arange(size, device=idx.device).view(shape))
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
    flat = row
    for j, size in enumerate(x_dense):
        flat = flat * size + positions[j]
    values = x.values.reshape(-1)[flat.reshape(-1)].reshape(total, *i_dense)
    return Ragged(values, index.offsets, index.sizes, index.layout)


def gather(x: Ragged, dim: int, index: Ragged) -> Ragged:
    """``torch.gather(x_i, dim, index_i)`` for each sample.

    Args:
        x: ``Ragged`` value.
        dim: logical axis to gather along (ragged or dense).
        index: int64 ``Ragged`` with the layout of ``x``; its ragged sizes equal
            those of ``x`` except along ``dim``, its dense sizes are at most
            those of ``x``. Values lie in ``[0, size of dim)`` in each sample.

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
