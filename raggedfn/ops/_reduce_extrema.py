"""Maxima, minima and their positions over logical axes (see :mod:`._reduce`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .._axes import normalize_axis
from .._errors import fail, require_ordered
from .._index import coordinates
from .._nested import row_positions
from .._prims import identity, segment_amax, segment_amin, segment_max, segment_min
from .._ragged import Ragged
from ._reduce_plan import (
    apply,
    finish,
    full_result,
    plan,
    reduced_axes,
    require_ragged,
    static_axes,
)

Dim = int | Sequence[int] | None
Result = Ragged | Tensor


def _size(values: Tensor, dims: tuple[int, ...]) -> int:
    """Number of elements along ``dims`` (a loop: dynamo rejects math.prod of SymInts)."""
    size = 1
    for d in dims:
        size = size * values.shape[d]
    return size


def _extremum(fn: str, x: Ragged, dim: Dim, keepdim: bool, largest: bool) -> Result:
    x = require_ragged(x, fn)
    require_ordered(fn, x.dtype)
    axes = reduced_axes(x, dim, fn)
    values = x.values
    if axes is None:
        if values.numel() == 0:
            empty = torch.full((), identity(values.dtype, largest), dtype=values.dtype)
            return full_result(x, empty.to(values.device), keepdim)
        return full_result(x, values.amax() if largest else values.amin(), keepdim)
    p = plan(x, axes)
    prim = segment_amax if largest else segment_amin
    if p.segments is not None and p.dense_dims:
        # One segment reduction over rows and dense axes together, so that ties
        # across both share the gradient evenly, as in torch.amax.
        inner = tuple(range(1, 1 + len(p.dense_dims)))
        moved = values.movedim(p.dense_dims, inner)
        per_row = _size(moved, inner)
        flat = moved.reshape(moved.shape[0] * per_row, *moved.shape[1 + len(inner) :])
        segments = torch.repeat_interleave(p.segments, per_row, output_size=flat.shape[0])
        reduced = prim(flat, segments, p.num_segments)
        shape = [p.num_segments, *values.shape[1:]]
        for d in p.dense_dims:
            shape[d] = 1
        return finish(x, p, reduced.reshape(shape), keepdim)

    def dense(v: Tensor, dims: tuple[int, ...]) -> Tensor:
        return v.amax(dims, keepdim=True) if largest else v.amin(dims, keepdim=True)

    def segment(v: Tensor, segments: Tensor, num: int, _counts: Tensor) -> Tensor:
        return prim(v, segments, num)

    return finish(x, p, apply(p, values, dense, segment), keepdim)


def amax(x: Ragged, dim: Dim = None, keepdim: bool = False) -> Result:
    """Maximum over logical axes; ties share the gradient evenly (as ``torch.amax``).

    An empty sample gives the identity: -inf, or the dtype's minimum for integers.

    Args:
        x: a ``Ragged`` value.
        dim: a logical axis, a tuple of them, or ``None`` for everything.
        keepdim: keep reduced axes with size 1.

    Returns:
        A ``Ragged`` if a ragged axis is left, else a dense tensor.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; an axis in ``dim`` is out of range or
            repeated.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([1.0, 3.0]), torch.tensor([])])
        >>> raggedfn.amax(x, 1)
        tensor([3., -inf])
    """
    return _extremum("amax", x, dim, keepdim, True)


def amin(x: Ragged, dim: Dim = None, keepdim: bool = False) -> Result:
    """Minimum over logical axes; see :func:`amax` (empty samples give +inf).

    Args:
        x: a ``Ragged`` value.
        dim: a logical axis, a tuple of them, or ``None`` for everything.
        keepdim: keep reduced axes with size 1.

    Returns:
        A ``Ragged`` if a ragged axis is left, else a dense tensor.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; an axis in ``dim`` is out of range or
            repeated.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([1.0, 3.0]), torch.tensor([])])
        >>> raggedfn.amin(x, 1)
        tensor([1., inf])
    """
    return _extremum("amin", x, dim, keepdim, False)


def _arg(fn: str, x: Ragged, dim: int | None, keepdim: bool, largest: bool) -> Result:
    x = require_ragged(x, fn)
    require_ordered(fn, x.dtype)
    if dim is None:
        raise fail(
            fn,
            "dim=None (a flat index into the whole batch) is not supported; pass one logical axis",
        )
    axis_index = normalize_axis(x, dim, fn, allow_batch=False)
    ragged, index = static_axes(x.layout)[axis_index - 1]
    p = plan(x, (axis_index,))
    values = x.values
    if not ragged:
        d = 1 + index
        arg = values.argmax(d, keepdim=True) if largest else values.argmin(d, keepdim=True)
        return finish(x, p, arg, keepdim)
    assert p.segments is not None
    prim = segment_max if largest else segment_min
    with torch.no_grad():
        rows = prim(values.detach(), p.segments, p.num_segments)[1]
        total = values.shape[0]
        if x.row_offsets:
            along = row_positions(x.sizes, x.row_offsets, total, index)
        else:
            along = coordinates(x.offsets, x.sizes, total)[1][index]
        # Row T of the extended coordinate is the -1 of an empty sample.
        extended = torch.cat([along, along.new_full((1,), -1)])
        arg = extended[torch.where(rows < 0, total, rows)]
    return finish(x, p, arg, keepdim)


def argmax(x: Ragged, dim: int | None = None, keepdim: bool = False) -> Result:
    """Index of the first maximum along one logical axis; -1 for an empty sample.

    Args:
        x: a ``Ragged`` value.
        dim: one logical axis (ragged or dense, not the batch axis).
        keepdim: keep the reduced axis with size 1.

    Returns:
        int64 positions along ``dim``: a ``Ragged`` if a ragged axis is left,
        else a dense tensor.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``dim`` is None (no flat index over a
            batch), out of range, or the batch axis.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([1.0, 3.0, 3.0]), torch.tensor([])])
        >>> raggedfn.argmax(x, 1)
        tensor([ 1, -1])
    """
    return _arg("argmax", x, dim, keepdim, True)


def argmin(x: Ragged, dim: int | None = None, keepdim: bool = False) -> Result:
    """Index of the first minimum along one logical axis; see :func:`argmax`.

    Args:
        x: a ``Ragged`` value.
        dim: one logical axis (ragged or dense, not the batch axis).
        keepdim: keep the reduced axis with size 1.

    Returns:
        int64 positions along ``dim``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``dim`` is None (no flat index over a
            batch), out of range, or the batch axis.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([1.0, 0.0, 0.0]), torch.tensor([])])
        >>> raggedfn.argmin(x, 1)
        tensor([ 1, -1])
    """
    return _arg("argmin", x, dim, keepdim, False)
