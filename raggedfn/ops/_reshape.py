"""Shape ops that regroup dense axes: ``flatten``, ``unflatten`` and ``reshape``.

Dense axes move in storage only where the merged axes are not adjacent, in
logical order, in storage; nested ragged axes join or split by their partitions
alone (``_nested_shape``).
"""

from __future__ import annotations

from collections.abc import Sequence

from .._axes import logical_shape_text, normalize_axis
from .._errors import describe, fail
from .._layout import Axis, Layout
from .._ragged import Ragged, like
from ._nested_shape import flatten_levels, unflatten_level
from ._shape import _require_ragged, dense_in_logical_order, reorder_dense

__all__ = ["flatten", "reshape", "unflatten"]


def flatten(x: Ragged, start_dim: int = 1, end_dim: int = -1) -> Ragged:
    """Merge logical axes ``start_dim..end_dim`` (all dense, or all nested ragged) into one.

    Dense axes: data moves only when they are not adjacent, in logical order, in
    storage. Consecutive nested ragged axes join into one ragged axis whose size
    is the sum of the inner sizes (``flatten(x, 1, 2)`` of documents of sentences
    ``(B, S*, L*, D)`` gives the tokens of each document ``(B, T*, D)``); only the
    partitions change.

    Args:
        x: a ``Ragged`` value.
        start_dim: first logical axis to merge.
        end_dim: last logical axis to merge (inclusive).

    Returns:
        ``Ragged`` with one axis in place of the merged ones.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``start_dim`` or ``end_dim`` is out of
            range, in the wrong order, or the range holds a ragged axis.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.zeros(2, 3, 4)])
        >>> raggedfn.flatten(x, 2, 3).shape
        (1, None, 12)
        >>> docs = raggedfn.from_nested_lengths(torch.zeros(5, 8), [[2, 1], [1, 2, 2]])
        >>> tokens = raggedfn.flatten(docs, 1, 2)
        >>> tokens.shape, tokens.lengths.tolist()
        ((2, None, 8), [3, 2])
    """
    fn = "flatten"
    _require_ragged(fn, x)
    start = normalize_axis(x, start_dim, fn, allow_batch=False) - 1
    end = normalize_axis(x, end_dim, fn, allow_batch=False) - 1
    if start > end:
        raise fail(fn, f"start_dim {start_dim} comes after end_dim {end_dim}")
    if start == end:
        return x
    group = x.layout.axes[start : end + 1]
    if x.row_offsets and any(a.ragged for a in group):
        return flatten_levels(fn, x, start, end)
    for p, a in enumerate(group):
        if a.ragged:
            raise fail(
                fn,
                f"axis {start + p + 1} is ragged (logical shape {logical_shape_text(x)}); "
                "only dense axes (or consecutive nested ragged axes) can be flattened",
            )
    members = [a.index for a in group]
    first = min(members)
    order = [j for j in range(x.layout.num_dense) if j not in members]
    slot = sum(1 for j in order if j < first)
    order[slot:slot] = members
    values, layout = reorder_dense(x.values, x.layout, order)
    count = len(members)
    values = values.flatten(1 + slot, slot + count)
    axes: list[Axis] = []
    for p, a in enumerate(layout.axes):
        if start < p <= end:
            continue
        if p == start:
            axes.append(Axis(False, slot))
        elif not a.ragged and a.index > slot:
            axes.append(Axis(False, a.index - count + 1))
        else:
            axes.append(a)
    return like(x, values, Layout(tuple(axes)))


def _resolve(fn: str, sizes: Sequence[int], numel: int, what: str) -> list[int]:
    sizes = [int(s) for s in sizes]
    unknown = [i for i, s in enumerate(sizes) if s == -1]
    if len(unknown) > 1 or any(s < -1 for s in sizes):
        raise fail(fn, f"{what} {tuple(sizes)} may hold at most one -1 and no other negative")
    known = 1
    for s in sizes:
        if s != -1:
            known *= s
    if unknown:
        if known == 0 or numel % known:
            raise fail(fn, f"{what} {tuple(sizes)} cannot hold {numel} elements")
        sizes[unknown[0]] = numel // known
    elif known != numel:
        raise fail(fn, f"{what} {tuple(sizes)} has {known} elements, expected {numel}")
    return sizes


def unflatten(x: Ragged, dim: int, sizes: Sequence[int] | Ragged) -> Ragged:
    """Split logical axis ``dim`` into ``sizes``; a view (no data moves).

    A dense axis splits into dense axes of the given sizes (one may be -1). A
    ragged axis splits into two nested ones with per-row lengths: ``sizes`` is
    then an integer ``Ragged`` holding the new outer level, e.g. the sentence
    lengths ``(B, S*)`` of a token batch ``(B, T*, D)``, whose rows add up to
    each sample's tokens; this reverses ``flatten`` of two nested axes.

    Args:
        x: a ``Ragged`` value.
        dim: the logical axis to split.
        sizes: the new dense axes' sizes (their product must equal the axis
            size), or, for a ragged axis, the lengths ``Ragged`` (its ragged axes
            are those of ``x`` above ``dim`` plus the new level).

    Returns:
        ``Ragged`` with the new axes in place of ``dim``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``dim`` is not an int or is out of
            range for the logical shape of ``x``, or is ragged; ``sizes`` is not a non-empty
            sequence of ints whose product is the axis size.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.zeros(2, 12)])
        >>> raggedfn.unflatten(x, 2, (3, -1)).shape
        (1, None, 3, 4)
        >>> tokens = raggedfn.from_lengths(torch.zeros(5, 8), [3, 2])
        >>> sentences = raggedfn.from_lengths(torch.tensor([1, 2, 2]), [2, 1])
        >>> docs = raggedfn.unflatten(tokens, 1, sentences)
        >>> docs.shape, docs.sizes.tolist()
        ((2, None, None, 8), [[2, 3], [1, 2]])
    """
    fn = "unflatten"
    _require_ragged(fn, x)
    d = normalize_axis(x, dim, fn, allow_batch=False)
    a = x.layout.axes[d - 1]
    if a.ragged and isinstance(sizes, Ragged):
        return unflatten_level(fn, x, d - 1, sizes)
    if a.ragged:
        raise fail(
            fn,
            f"axis {d} is ragged (logical shape {logical_shape_text(x)}); it splits into "
            "nested ragged axes with per-row lengths given as a Ragged value, not sizes "
            f"{describe(sizes)}",
        )
    if isinstance(sizes, int) or not isinstance(sizes, Sequence) or not sizes:
        raise fail(fn, f"sizes must be a non-empty sequence of ints, got {describe(sizes)}")
    new_sizes = _resolve(fn, sizes, x.values.shape[1 + a.index], "sizes")
    count = len(new_sizes)
    values = x.values.unflatten(1 + a.index, new_sizes)
    axes: list[Axis] = []
    for p, b in enumerate(x.layout.axes):
        if p == d - 1:
            axes.extend(Axis(False, a.index + i) for i in range(count))
        elif not b.ragged and b.index > a.index:
            axes.append(Axis(False, b.index + count - 1))
        else:
            axes.append(b)
    return like(x, values, Layout(tuple(axes)))


def reshape(x: Ragged, shape: Sequence[int | None]) -> Ragged:
    """Reshape the dense axes; ragged axes stay, marked ``None`` in ``shape``.

    ``shape`` is the full logical shape ``(B, ...)``: its first entry is ``B`` or
    -1, ragged axes appear as ``None`` (as many as ``x`` has), and the dense axes
    between two ragged axes are reshaped as a group (one -1 allowed per group).

    Args:
        x: a ``Ragged`` value.
        shape: the new logical shape.

    Returns:
        ``Ragged`` whose dense axes are stored in logical order.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``shape`` does not start with the
            batch size (or -1), does not mark each ragged axis with None, holds entries that
            are not ints or None, or changes the number of dense elements.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.zeros(2, 3, 4)])
        >>> raggedfn.reshape(x, (1, None, 12)).shape, raggedfn.reshape(x, (-1, None, 2, 6)).shape
        ((1, None, 12), (1, None, 2, 6))
    """
    fn = "reshape"
    _require_ragged(fn, x)
    if isinstance(shape, int) or not isinstance(shape, Sequence) or not shape:
        raise fail(fn, f"shape must be a sequence (B, ...), got {describe(shape)}")
    shape = list(shape)
    if shape[0] is None or shape[0] not in (-1, x.batch_size):
        raise fail(fn, f"shape {tuple(shape)} must start with the batch size {x.batch_size} or -1")
    sample = shape[1:]
    if sum(1 for s in sample if s is None) != x.num_ragged:
        raise fail(
            fn,
            f"shape {tuple(shape)} must mark the {x.num_ragged} ragged axes of "
            f"(B, {logical_shape_text(x)[1:]} with None",
        )
    dense_shape = x.values.shape[1:]
    old_groups: list[int] = [1]
    for a in x.layout.axes:
        if a.ragged:
            old_groups.append(1)
        else:
            old_groups[-1] *= dense_shape[a.index]
    new_groups: list[list[int]] = [[]]
    for s in sample:
        if s is None:
            new_groups.append([])
        elif not isinstance(s, int) or isinstance(s, bool):
            raise fail(fn, f"shape entries must be ints or None, got {describe(s)}")
        else:
            new_groups[-1].append(s)
    resolved = [
        _resolve(fn, g, n, f"shape {tuple(shape)} group")
        for g, n in zip(new_groups, old_groups, strict=True)
    ]
    values, _ = reorder_dense(x.values, x.layout, dense_in_logical_order(x.layout))
    new_dense = [s for g in resolved for s in g]
    values = values.reshape(values.shape[0], *new_dense)
    ragged = iter([a for a in x.layout.axes if a.ragged])
    axes: list[Axis] = []
    j = 0
    for s in sample:
        if s is None:
            axes.append(next(ragged))
        else:
            axes.append(Axis(False, j))
            j += 1
    return like(x, values, Layout(tuple(axes)))
