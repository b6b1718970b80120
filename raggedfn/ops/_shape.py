"""Shape ops: exchange, insert and remove logical axes, and store them in logical order.

Exchanging axes (``transpose``, ``permute``) changes only the layout: the packed
``values`` are shared, not copied. Data moves only where an op needs a physical
order (``contiguous``). Regrouping dense axes (``flatten``, ``unflatten``,
``reshape``) lives in ``_reshape``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from .._axes import logical_shape_text, normalize_axes, normalize_axis
from .._errors import describe, fail
from .._layout import Axis, Layout
from .._ragged import Ragged, like

__all__ = [
    "contiguous",
    "permute",
    "squeeze",
    "transpose",
    "unsqueeze",
]


# ----- layout helpers (shared with _reshape, _nn and _elementwise) ---------------------------


def _require_ragged(fn: str, x: object) -> None:
    if not isinstance(x, Ragged):
        raise fail(fn, f"x must be a Ragged value, got {describe(x)}")


def reorder_dense(values: Tensor, layout: Layout, order: Sequence[int]) -> tuple[Tensor, Layout]:
    """Store the dense axes in ``order`` (``order[new j] = old j``); a view, no copy.

    The logical order of the value is unchanged; only the storage numbering moves.
    """
    order = list(order)
    if order == list(range(len(order))):
        return values, layout
    new_of_old = {old: new for new, old in enumerate(order)}
    values = values.permute(0, *(1 + j for j in order))
    axes = tuple(a if a.ragged else Axis(False, new_of_old[a.index]) for a in layout.axes)
    return values, Layout(axes)


def dense_in_logical_order(layout: Layout) -> list[int]:
    """Storage indices of the dense axes, in logical order."""
    return [a.index for a in layout.axes if not a.ragged]


def trailing_dense(x: Ragged, count: int, fn: str) -> tuple[Tensor, Layout]:
    """``values`` whose last ``count`` storage axes are the last ``count`` logical axes.

    Raises ``RaggedError`` when one of those logical axes is ragged.
    """
    axes = x.layout.axes
    if count > len(axes):
        raise fail(
            fn,
            f"needs the last {count} axes to be dense but a sample has rank {len(axes)} "
            f"(logical shape {logical_shape_text(x)})",
        )
    tail = axes[len(axes) - count :]
    for p, a in enumerate(tail):
        if a.ragged:
            raise fail(
                fn,
                f"axis {len(axes) - count + p + 1} is ragged but must be dense "
                f"(logical shape {logical_shape_text(x)}); only trailing dense axes qualify",
            )
    moved = [a.index for a in tail]
    rest = [j for j in range(x.layout.num_dense) if j not in moved]
    return reorder_dense(x.values, x.layout, rest + moved)


# ----- layout-only ops --------------------------------------------------------------


def transpose(x: Ragged, dim0: int, dim1: int) -> Ragged:
    """Exchange two logical axes (not the batch axis); layout only, no copy.

    Args:
        x: a ``Ragged`` value.
        dim0: a logical axis (batch = 0, negative allowed), ragged or dense.
        dim1: the axis to exchange it with.

    Returns:
        ``Ragged`` sharing ``x.values`` with the two axes exchanged.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``dim0`` or ``dim1`` is out of range
            or the batch axis.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.zeros(2, 3), torch.zeros(4, 3)])
        >>> y = raggedfn.transpose(x, 1, 2)
        >>> y.shape, y.values is x.values
        ((2, 3, None), True)
    """
    fn = "transpose"
    _require_ragged(fn, x)
    a = normalize_axis(x, dim0, fn, allow_batch=False) - 1
    b = normalize_axis(x, dim1, fn, allow_batch=False) - 1
    axes = list(x.layout.axes)
    axes[a], axes[b] = axes[b], axes[a]
    return like(x, x.values, Layout(tuple(axes)))


def permute(x: Ragged, dims: Sequence[int]) -> Ragged:
    """Reorder the logical axes; the batch axis must stay first. Layout only, no copy.

    Args:
        x: a ``Ragged`` value of logical rank ``ndim``.
        dims: a permutation of ``range(ndim)`` starting with ``0``.

    Returns:
        ``Ragged`` sharing ``x.values`` whose axis ``i`` is ``x``'s axis ``dims[i]``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``dims`` is not a permutation of the
            logical axes, or moves the batch axis.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.zeros(2, 3, 4)])
        >>> raggedfn.permute(x, (0, 3, 1, 2)).shape
        (1, 4, None, 3)
    """
    fn = "permute"
    _require_ragged(fn, x)
    if isinstance(dims, int) or not isinstance(dims, Sequence):
        raise fail(fn, f"dims must be a sequence of ints, got {describe(dims)}")
    if len(dims) != x.ndim:
        raise fail(
            fn,
            f"dims {tuple(dims)} must have {x.ndim} entries, one per logical axis of "
            f"(B, {logical_shape_text(x)[1:]}",
        )
    normal = [normalize_axis(x, d, fn) for d in dims]
    if sorted(normal) != list(range(x.ndim)):
        raise fail(fn, f"dims {tuple(dims)} must be a permutation of {tuple(range(x.ndim))}")
    if normal[0] != 0:
        raise fail(fn, f"dims {tuple(dims)} must keep the batch axis 0 first")
    axes = tuple(x.layout.axes[d - 1] for d in normal[1:])
    return like(x, x.values, Layout(axes))


def unsqueeze(x: Ragged, dim: int) -> Ragged:
    """Insert a dense axis of size 1 at logical axis ``dim`` (a view).

    Args:
        x: a ``Ragged`` value of logical rank ``ndim``.
        dim: where the new axis goes, in ``[1, ndim]`` (negative counts from
            ``ndim + 1`` like torch).

    Returns:
        ``Ragged`` of rank ``ndim + 1``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``dim`` is not an int, is out of
            range, or would go before the batch axis.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.zeros(2, 3)])
        >>> raggedfn.unsqueeze(x, 2).shape, raggedfn.unsqueeze(x, -1).shape
        ((1, None, 1, 3), (1, None, 3, 1))
    """
    fn = "unsqueeze"
    _require_ragged(fn, x)
    ndim = x.ndim
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise fail(fn, f"dim must be an int, got {describe(dim)}")
    if not -(ndim + 1) <= dim <= ndim:
        raise fail(
            fn,
            f"dim {dim} is out of range for inserting into logical shape "
            f"(B, {logical_shape_text(x)[1:]} (expected {-(ndim + 1)} <= dim <= {ndim})",
        )
    dim = dim % (ndim + 1)
    if dim == 0:
        raise fail(fn, "dim 0 would go before the batch axis; use dim >= 1")
    new = Axis(False, x.layout.num_dense)
    axes = list(x.layout.axes)
    axes.insert(dim - 1, new)
    return like(x, x.values.unsqueeze(-1), Layout(tuple(axes)))


def squeeze(x: Ragged, dim: int | Sequence[int] | None = None) -> Ragged:
    """Remove dense axes of size 1 (all of them when ``dim`` is None), like torch.

    A named dense axis whose size is not 1 is left in place (torch semantics); a
    ragged or batch axis raises ``RaggedError``.

    Args:
        x: a ``Ragged`` value.
        dim: a logical axis, a tuple of them, or None.

    Returns:
        ``Ragged`` without those axes (a view of ``x.values``).

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; an axis in ``dim`` is out of range or
            ragged.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.zeros(1, 2, 1)], ragged_dims=(2,))
        >>> raggedfn.squeeze(x).shape
        (1, None)
    """
    fn = "squeeze"
    _require_ragged(fn, x)
    dense_shape = x.values.shape[1:]
    if dim is None:
        targets = [
            p for p, a in enumerate(x.layout.axes) if not a.ragged and dense_shape[a.index] == 1
        ]
    else:
        targets = []
        for d in normalize_axes(x, dim, fn, allow_batch=False):
            a = x.layout.axes[d - 1]
            if a.ragged:
                raise fail(
                    fn,
                    f"axis {d} is ragged (logical shape {logical_shape_text(x)}); "
                    "only dense axes of size 1 can be squeezed",
                )
            if dense_shape[a.index] == 1:
                targets.append(d - 1)
    if not targets:
        return x
    removed = sorted(x.layout.axes[p].index for p in targets)
    values = x.values.squeeze(tuple(1 + j for j in removed))
    axes = tuple(
        a if a.ragged else Axis(False, a.index - sum(1 for r in removed if r < a.index))
        for p, a in enumerate(x.layout.axes)
        if p not in targets
    )
    return like(x, values, Layout(axes))


def contiguous(x: Ragged) -> Ragged:
    """Store ``x`` in its logical order: same logical value, standard storage.

    Ragged axes are renumbered so that storage order (``k``) follows logical order
    (packed rows are gathered when that changes) and dense axes are stored in
    logical order in a contiguous ``values``. When ragged axes come first the
    layout becomes ``Layout.standard``.

    Args:
        x: a ``Ragged`` value.

    Returns:
        ``Ragged`` equal to ``x`` sample by sample, with
        ``Layout.from_ragged_positions`` layout and contiguous ``values``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.arange(6.0).reshape(2, 3)], ragged_dims=(1, 2))
        >>> y = raggedfn.contiguous(raggedfn.transpose(x, 1, 2))
        >>> y.values.tolist(), y.sizes.tolist()
        ([0.0, 3.0, 1.0, 4.0, 2.0, 5.0], [[3, 2]])
    """
    from ._broadcast import gather_rows

    fn = "contiguous"
    _require_ragged(fn, x)
    values, layout = reorder_dense(x.values, x.layout, dense_in_logical_order(x.layout))
    ragged_order = [a.index for a in layout.axes if a.ragged]
    sizes = x.sizes
    if ragged_order != sorted(ragged_order):
        sizes = x.sizes[:, ragged_order]
        positions = tuple(p for p, a in enumerate(layout.axes) if a.ragged)
        target = Layout.from_ragged_positions(layout.rank, positions)
        source = Ragged(values, x.offsets, x.sizes, layout)
        values = gather_rows(source, x.offsets, sizes, target, values.shape[0])
        layout = target  # dense axes are already numbered in logical order
    return Ragged(values.contiguous(), x.offsets, sizes, layout, x.row_offsets)
