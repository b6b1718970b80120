"""Aligning operands of elementwise ops, including broadcasts that create ragged axes.

Every operand is brought to the result's storage: packed rows in the result's
ragged order (``[T_out, ...]``, or ``[1, ...]`` for per-feature tensors) and
dense axes in the result's storage order, with size 1 where they broadcast.

A size-1 dense axis broadcasts against a ragged axis of the same sample: with
``x`` of logical shape ``(B, N*, D)``, ``unsqueeze(x, 2) + unsqueeze(x, 1)`` is a
pair state ``(B, N*, N*, D)``. Only the real ``sum N_i * M_i`` rows are
allocated: each operand's rows are gathered with index tensors built from the
result's coordinates, never padded.

Creating a ragged axis needs the new total row count as a Python int, so that
(only that) reads one number from the device. Same-partition operands never
sync in compiled code.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Number
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._errors import describe, fail, shape_text
from .._index import coordinates, offsets_of, segment_ids
from .._layout import Layout
from .._mixed import group_start
from .._nested import ancestors, level_offsets, parents
from .._prims import take_rows
from .._ragged import Ragged
from .._validate import is_tracing

__all__ = ["broadcast_tensors"]


class Partition(NamedTuple):
    """The partition (and layout) of an elementwise result."""

    offsets: Tensor
    sizes: Tensor
    layout: Layout
    row_offsets: tuple[Tensor, ...] = ()

    def build(self, values: Tensor) -> Ragged:
        return Ragged(values, self.offsets, self.sizes, self.layout, self.row_offsets)


def same_row_offsets(x: Ragged, y: Ragged) -> bool:
    """Whether two values hold the very same nested partitions (none counts)."""
    return len(x.row_offsets) == len(y.row_offsets) and all(
        a is b for a, b in zip(x.row_offsets, y.row_offsets, strict=True)
    )


def _nested_prefix_rows(fn: str, op: Ragged, base: Ragged, index: int) -> Tensor:
    """Rows of ``op`` for every row of the nested ``base``, when ``op``'s ragged axes are
    the first levels of ``base``'s chain (sentence features against tokens): each row
    of ``base`` takes the row of its ancestor on ``op``'s innermost level."""
    levels = op.num_ragged
    own = [p for p, a in enumerate(op.layout.axes) if a.ragged]
    chain = [p for p, a in enumerate(base.layout.axes) if a.ragged]
    if own != chain[:levels]:
        raise fail(
            fn,
            f"operand {index} has ragged axes at logical axes {[p + 1 for p in own]} but the "
            f"nested operand's levels are at {[p + 1 for p in chain]}; a Ragged operand must "
            "hold the outermost levels of the nested one (size 1 along the inner levels)",
        )
    if levels > 1 and not op.row_offsets:  # a rectangle: base's first axes must be one
        if group_start(base.layout, levels - 1) != 0:
            raise fail(
                fn,
                f"operand {index} has rectangular ragged axes but the nested operand's "
                f"first {levels} ragged axes are not one rectangle (layout {base.layout.code!r})",
            )
        check_equal(fn, "sizes", torch.cumprod(op.sizes, 1), base.sizes[:, :levels])
    else:
        check_equal(fn, "sizes", op.sizes, base.sizes[:, :levels])
    for k, parts in enumerate(op.row_offsets):
        check_equal(fn, f"row_offsets[{k}]", parts, base.row_offsets[k])
    level = level_offsets(base.sizes, base.row_offsets)[levels - 1]
    check_equal(fn, "offsets", op.offsets, level)
    owners = parents(base.sizes, base.row_offsets, base.values.shape[0])
    return ancestors(owners, levels - 1)


def check_equal(
    fn: str,
    what: str,
    a: Tensor,
    b: Tensor,
    explain: str = "only values with the same samples and sizes combine elementwise",
) -> None:
    """Require two partition tensors to hold the same values.

    The same object is free. Eagerly the data is compared (one host sync) and a
    mismatch raises ``RaggedError``. While tracing there is no data to compare
    and skipping the check could silently mix partitions, so a runtime assertion
    goes into the graph instead (a mismatch raises ``RuntimeError`` when the
    compiled code runs).
    """
    if a is b:
        return
    if a.shape != b.shape:
        raise fail(
            fn,
            f"operands have different partitions: {what} of shape {shape_text(a.shape)} and "
            f"{shape_text(b.shape)} ({explain})",
        )
    if is_tracing(a) or is_tracing(b):
        torch._assert_async((a == b).all(), f"{fn}: operands have different partitions ({what})")
        return
    if not torch.equal(a, b):
        raise fail(
            fn,
            f"operands have different partitions: {what} {a.tolist()[:8]} and {b.tolist()[:8]} "
            f"differ ({explain})",
        )


def ragged_positions(layout: Layout) -> dict[int, int]:
    """Sample position -> ragged axis ``k``."""
    return {p: a.index for p, a in enumerate(layout.axes) if a.ragged}


def gather_rows(
    x: Ragged,
    offsets: Tensor,
    sizes: Tensor,
    layout: Layout,
    total: int,
    index: tuple[Tensor, list[Tensor]] | None = None,
    values: Tensor | None = None,
) -> Tensor:
    """``x.values`` rows gathered into a result partition (``offsets``, ``sizes``, ``layout``).

    Every ragged axis of ``x`` must be ragged at the same logical position in
    ``layout``; the result's other ragged axes broadcast (``x`` repeats along them).
    ``index`` is ``coordinates(offsets, sizes, total)`` when already computed;
    ``values`` replaces ``x.values`` (same rows, e.g. with axes squeezed).
    """
    segments, coords = index if index is not None else coordinates(offsets, sizes, total)
    result_k = ragged_positions(layout)
    row = x.offsets.index_select(0, segments)
    stride: Tensor | None = None  # None stands for 1 (the last ragged axis)
    position_of = {k: p for p, k in ragged_positions(x.layout).items()}
    for k in range(x.layout.num_ragged - 1, -1, -1):
        coord = coords[result_k[position_of[k]]]
        row = row + (coord if stride is None else coord * stride)
        if k:
            size = x.sizes[:, k].index_select(0, segments)
            stride = size if stride is None else stride * size
    # index_select (about 5x faster than advanced indexing on CPU for row gathers) where
    # inductor compiles it right: _prims.take_rows
    return take_rows(x.values if values is None else values, row)


def _sample_shape(op: Any) -> list[Any]:
    """Per sample position: ("r", k) for ragged, ("d", size) for dense."""
    dense = op.values.shape[1:]
    return [("r", a.index) if a.ragged else ("d", dense[a.index]) for a in op.layout.axes]


def align(fn: str, operands: Sequence[Any]) -> tuple[list[Any], Partition]:
    """Operands laid out like the result, plus the result's partition and layout.

    ``operands`` holds at least one ``Ragged``; the others may be Python numbers,
    0-d tensors, or dense tensors that broadcast against the logical shape
    ``(B, ...)`` from the right (a leading batch axis of size ``B`` gives a
    per-sample tensor; size-1 axes broadcast along ragged axes).
    """
    raggeds = [op for op in operands if isinstance(op, Ragged)]
    first = raggeds[0]
    # by identity: list.index would compare with Ragged.__eq__ (elementwise)
    first_index = next(i for i, op in enumerate(operands) if op is first)
    ndim, rank, batch = first.ndim, first.layout.rank, first.batch_size
    device = first.device
    for i, op in enumerate(operands):
        if isinstance(op, Ragged):
            if op.ndim != ndim:
                raise fail(
                    fn,
                    f"operand {i} has logical shape {shape_text(op.shape)} but operand "
                    f"{first_index} has {shape_text(first.shape)}; Ragged operands need the same "
                    "rank (insert size-1 axes with unsqueeze)",
                )
            if op.offsets.shape != first.offsets.shape:
                raise fail(
                    fn,
                    f"operands have different partitions: batch sizes {batch} and {op.batch_size}",
                )
        elif isinstance(op, Tensor):
            if op.ndim > ndim:
                raise fail(
                    fn,
                    f"operand {i} ({describe(op)}) has more axes than the logical shape "
                    f"{shape_text(first.shape)}",
                )
        elif not isinstance(op, (Number, torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise fail(
                fn,
                f"operand {i} must be a Ragged value, a tensor or a number, got {describe(op)}",
            )
        if (isinstance(op, Ragged) or (isinstance(op, Tensor) and op.ndim)) and op.device != device:
            raise fail(
                fn, f"operand {i} is on {op.device}, expected {device} like the Ragged operand"
            )
    # Per logical sample position: which operands are ragged there, and dense sizes.
    shapes: list[list[Any] | None] = []
    for op in operands:
        if isinstance(op, Ragged):
            shapes.append(_sample_shape(op))
        elif isinstance(op, Tensor) and op.ndim:
            pad = [1] * (ndim - op.ndim) + list(op.shape)
            if pad[0] != 1 and pad[0] != batch:
                raise fail(
                    fn,
                    f"tensor operand of shape {shape_text(op.shape)} has {pad[0]} along the batch "
                    f"axis, expected {batch} or 1 (logical shape {shape_text(first.shape)})",
                )
            shapes.append([("d", s) for s in pad[1:]])
        else:
            shapes.append(None)
    ragged_at = sorted({p for s in shapes if s is not None for p, e in enumerate(s) if e[0] == "r"})
    for p in range(rank):
        entries = [(i, s[p]) for i, s in enumerate(shapes) if s is not None]
        if p in ragged_at:
            for i, e in entries:
                if e[0] == "d" and e[1] != 1:
                    raise fail(
                        fn,
                        f"operand {i} has size {e[1]} along logical axis {p + 1}, which is ragged "
                        "in another operand; only size 1 broadcasts against a ragged axis",
                    )
        else:
            found = {e[1] for _, e in entries} - {1}
            if len(found) > 1:
                raise fail(
                    fn,
                    f"operands have sizes {sorted(found)} along dense logical axis {p + 1}, "
                    "which do not broadcast",
                )
    base = next((op for op in raggeds if sorted(ragged_positions(op.layout)) == ragged_at), None)
    nested = next((op for op in raggeds if op.row_offsets), None)
    if nested is not None:
        base = raggeds[0]
        for op in raggeds[1:]:  # the operand with the most levels (dynamo: no max(key=))
            if op.num_ragged > base.num_ragged:
                base = op
        if base.num_ragged != len(ragged_at) or not base.row_offsets:
            raise fail(
                fn,
                f"operands with nested ragged axes combine only with values holding their "
                f"outermost levels (or size 1 there); got ragged logical axes "
                f"{[p + 1 for p in ragged_at]} across operands",
            )
    index: tuple[Tensor, list[Tensor]] | None = None
    owner_of: dict[int, Ragged] = {}
    if base is not None:
        layout, offsets, sizes = base.layout, base.offsets, base.sizes
        total = base.values.shape[0]
    else:
        layout = Layout.from_ragged_positions(rank, tuple(ragged_at))
        columns = []
        for p in ragged_at:
            owner = next(op for op in raggeds if p in ragged_positions(op.layout))
            owner_of[p] = owner
            columns.append(owner.sizes[:, ragged_positions(owner.layout)[p]])
        sizes = torch.stack(columns, 1)
        offsets = offsets_of(sizes.prod(dim=1))
        total = int(offsets[-1])  # the one host sync: the new row count
    result_k = ragged_positions(layout)
    dense_order = sorted(
        (p for p in range(rank) if p not in result_k), key=lambda p: layout.axes[p].index
    )
    segments: Tensor | None = None
    prepared: list[Any] = []
    for position, op in enumerate(operands):
        if isinstance(op, Ragged):
            own = ragged_positions(op.layout)
            # size-1 dense axes that broadcast against result ragged axes go first:
            # gathering rows of a tensor with a trailing size-1 axis is ~10x slower
            squeezed = sorted(op.layout.axes[p].index for p in result_k if p not in own)
            values = op.values
            if squeezed:
                values = values.squeeze(tuple(1 + j for j in squeezed))
            if sorted(own) == ragged_at and all(result_k[p] == k for p, k in own.items()):
                if op is not base:
                    check_equal(fn, "sizes", op.sizes, sizes)
                    check_equal(fn, "offsets", op.offsets, offsets)
                    if nested is not None and base is not None:
                        if op.layout.num_nested != layout.num_nested:
                            raise fail(
                                fn,
                                "operands have different partitions: one has nested ragged "
                                "axes, the other rectangular ones",
                            )
                        for k, parts in enumerate(op.row_offsets):
                            check_equal(fn, f"row_offsets[{k}]", parts, base.row_offsets[k])
                    if is_tracing(offsets):
                        # equal partitions have equal row counts: tell the tracer, so that
                        # a data-dependent count (from a product or a new ragged axis)
                        # unifies with this one instead of failing to broadcast
                        torch._check(
                            values.shape[0] == total,
                            lambda: (
                                f"{fn}: operands have different partitions (packed row "
                                "counts values.shape[0] differ)"
                            ),
                        )
            elif nested is not None:
                assert base is not None
                rows = _nested_prefix_rows(fn, op, base, position)
                values = take_rows(values, rows)
            else:
                for p, k in own.items():
                    same = op.sizes is sizes and k == result_k[p]
                    if owner_of.get(p) is not op and not same:
                        check_equal(
                            fn, f"sizes along axis {p + 1}", op.sizes[:, k], sizes[:, result_k[p]]
                        )
                if index is None:
                    index = coordinates(offsets, sizes, total)
                values = gather_rows(op, offsets, sizes, layout, total, index, values)
            remaining = [j for j in range(op.layout.num_dense) if j not in squeezed]
            order = [remaining.index(op.layout.axes[p].index) for p in dense_order]
            if order != sorted(order):
                values = values.permute(0, *(1 + j for j in order))
            prepared.append(values)
        elif isinstance(op, Tensor) and op.ndim:
            t = op.reshape((1,) * (ndim - op.ndim) + tuple(op.shape))
            if t.shape[0] != 1:
                if segments is None:
                    segments = index[0] if index is not None else segment_ids(offsets, total)
                t = take_rows(t, segments)
            if result_k:
                t = t.squeeze(tuple(1 + p for p in result_k))
            logical = sorted(dense_order)
            order = [logical.index(p) for p in dense_order]
            if order != sorted(order):
                t = t.permute(0, *(1 + j for j in order))
            prepared.append(t)
        else:
            prepared.append(op)
    row_offsets = base.row_offsets if base is not None and nested is not None else ()
    return prepared, Partition(offsets, sizes, layout, row_offsets)


def broadcast_tensors(*xs: Any) -> tuple[Ragged, ...]:
    """Broadcast operands against each other like ``torch.broadcast_tensors``.

    Size-1 axes broadcast against ragged axes too, creating them (see module
    docstring); the results share one partition and layout.

    Args:
        xs: ``Ragged`` values (at least one), dense tensors or numbers.

    Returns:
        One ``Ragged`` per operand, all of the same logical shape and partition.

    Raises:
        RaggedError: no operand is ``Ragged``; operands that do not combine (as for
            :func:`add`).

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(2, 3), torch.ones(1, 3)])
        >>> a, b = raggedfn.broadcast_tensors(raggedfn.unsqueeze(x, 2), raggedfn.unsqueeze(x, 1))
        >>> a.shape, a.sizes.tolist(), a.values.shape
        ((2, None, None, 3), [[2, 2], [1, 1]], torch.Size([5, 3]))
    """
    fn = "broadcast_tensors"
    if not any(isinstance(x, Ragged) for x in xs):
        raise fail(fn, "needs at least one Ragged operand")
    prepared, partition = align(fn, xs)
    dtype = next(x.dtype for x in xs if isinstance(x, Ragged))
    shape = torch.broadcast_shapes(*(p.shape if isinstance(p, Tensor) else () for p in prepared))
    out = []
    for p in prepared:
        t = (
            p
            if isinstance(p, Tensor)
            else torch.tensor(p, dtype=dtype, device=partition.offsets.device)
        )
        out.append(partition.build(t.expand(shape)))
    return tuple(out)
