"""Per-sample ``sort``, ``argsort`` and ``topk`` along a ragged or dense axis.

Sorts are stable. Along a dense axis: one ``torch.sort`` of the packed values;
along a ragged axis every line (the elements that differ only along that axis)
is sorted by two stable sorts of the packed rows (by value, then by line), with
no loop over samples. Indices are coordinates along the sorted axis. ``topk`` is
a sort followed by ``narrow``.
"""

from __future__ import annotations

import math

import torch

from .._axes import innermost_nested, sample_axis, values_dim
from .._errors import describe, fail, require_ordered
from .._index import coordinates
from .._nested import parents, reduced_levels, row_positions
from .._ragged import Ragged
from ._select import _require, narrow

__all__ = ["argsort", "sort", "topk"]


def _sort(fn: str, x: Ragged, dim: int, descending: bool) -> tuple[Ragged, Ragged]:
    x = _require(fn, "x", x)
    require_ordered(fn, x.dtype)
    axis = sample_axis(x, dim, fn)
    if not axis.ragged:
        values, indices = torch.sort(
            x.values, dim=values_dim(axis), descending=descending, stable=True
        )
        return x.with_values(values), x.with_values(indices)
    total = x.values.shape[0]
    dense = x.values.shape[1:]
    flat = x.values.reshape(total, math.prod(dense))
    if x.row_offsets:
        if axis.index == x.num_ragged - 1:  # a line: the rows of one element above
            line = parents(x.sizes, x.row_offsets, total)[-1]
        else:  # an outer axis: the rows at one aligned position of the levels below
            line, _, _ = reduced_levels(x.sizes, x.row_offsets, total, (axis.index,), False)
        along = row_positions(x.sizes, x.row_offsets, total, axis.index)
    else:
        segments, coords = coordinates(x.offsets, x.sizes, total)
        stride = torch.ones_like(segments)
        for k in range(x.num_ragged - 1, axis.index, -1):
            stride = stride * x.sizes[segments, k]
        along = coords[axis.index]
        line = torch.arange(total, device=x.device) - along * stride  # first row of each line
    _, by_value = torch.sort(flat.detach(), dim=0, descending=descending, stable=True)
    _, by_line = torch.sort(line[by_value], dim=0, stable=True)
    source = by_value.gather(0, by_line)  # rows grouped by line, sorted inside each
    slots = torch.sort(line, stable=True).indices  # packed rows grouped by line, in order
    inverse = torch.empty_like(slots)
    inverse[slots] = torch.arange(total, device=x.device)
    source = source.index_select(0, inverse)
    values = flat.gather(0, source).reshape(total, *dense)
    indices = along[source].reshape(total, *dense)
    return x.with_values(values), x.with_values(indices)


def sort(x: Ragged, dim: int = -1, descending: bool = False) -> tuple[Ragged, Ragged]:
    """``torch.sort(x_i, dim, descending, stable=True)`` for each sample.

    Args:
        x: ``Ragged`` value (real dtype).
        dim: logical axis, ragged or dense.
        descending: sort largest first.

    Returns:
        ``(values, indices)``, both with the partition and layout of ``x``;
        indices are positions along ``dim`` inside each sample (ties keep their
        order; NaN sorts as the largest value, as in torch). Along an outer
        nested axis every aligned line (the elements with one position on the
        levels below) is sorted and indices are coordinates along ``dim``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``dim`` is not an int or is out of
            range for the logical shape of ``x``, or is the batch axis; ``x`` is
            complex (no order).

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0.0])])
        >>> v, i = raggedfn.sort(x, 1)
        >>> v.values.tolist(), i.values.tolist()
        ([1.0, 2.0, 3.0, 0.0], [1, 2, 0, 0])
    """
    return _sort("sort", x, dim, descending)


def argsort(x: Ragged, dim: int = -1, descending: bool = False) -> Ragged:
    """The indices of :func:`sort` (stable).

    Args:
        x: ``Ragged`` value (real dtype).
        dim: logical axis, ragged or dense.
        descending: sort largest first.

    Returns:
        int64 ``Ragged`` with the partition and layout of ``x``: positions along ``dim``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``dim`` is not an int or is out of
            range for the logical shape of ``x``, or is the batch axis; ``x`` is
            complex (no order).

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([3.0, 1.0, 2.0])])
        >>> raggedfn.argsort(x, 1, descending=True).values.tolist()
        [0, 2, 1]
    """
    return _sort("argsort", x, dim, descending)[1]


def topk(
    x: Ragged, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
) -> tuple[Ragged, Ragged]:
    """The ``k`` largest (or smallest) elements of each sample along ``dim``.

    Along a ragged axis ``k`` is clamped to each sample's size there, so the
    result stays ragged with ``min(k, N_i)`` elements. The result is always
    sorted (``sorted=False`` is accepted and gives the same order); ties keep
    their original order.

    With nested ragged axes it works along the innermost one (within every
    element above it: the ``k`` largest tokens of each sentence) and along dense
    axes. Along an outer nested axis it raises ``RaggedError``: the ``k`` largest
    of every aligned line (the sentences that have a token ``j``) sit at
    different sentences for different ``j``, so keeping them in place leaves
    holes (no ragged result), and packing them to the front as padding would
    (``topk`` of the padded tensor) changes which sentence a token belongs to.
    Use ``sort`` along that axis (it keeps the partition) and ``narrow``, or
    reduce or flatten the inner axes first.

    Args:
        x: ``Ragged`` value (real dtype).
        k: number of elements (``>= 0``).
        dim: logical axis, ragged or dense (a dense axis needs ``k <=`` its size).
        largest: largest first (else smallest first).
        sorted: accepted for torch compatibility.

    Returns:
        ``(values, indices)`` like ``torch.topk``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``k`` is not an int ``>= 0``, or
            exceeds a dense axis ``dim``; ``dim`` is not an int or is out of range for the
            logical shape of ``x``; ``dim`` is an outer nested ragged axis.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([3.0, 1.0, 2.0]), torch.tensor([5.0])])
        >>> v, i = raggedfn.topk(x, 2, dim=1)
        >>> v.values.tolist(), v.lengths.tolist()
        ([3.0, 2.0, 5.0], [2, 1])
    """
    fn = "topk"
    x = _require(fn, "x", x)
    require_ordered(fn, x.dtype)
    axis = sample_axis(x, dim, fn)
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise fail(fn, f"k must be an int >= 0, got {describe(k)}")
    if not axis.ragged and k > x.values.shape[values_dim(axis)]:
        raise fail(
            fn, f"k = {k} exceeds dense axis {dim} of size {x.values.shape[values_dim(axis)]}"
        )
    innermost_nested(fn, x, axis, dim)
    values, indices = _sort(fn, x, dim, descending=largest)
    return narrow(values, dim, 0, k), narrow(indices, dim, 0, k)
