"""Products of nested values per element of their outer levels.

``einsum('bstd,bsud->bstu', docs, docs)`` is, per document and per sentence,
``einsum('td,ud->tu')``: a pair state per sentence. Every operand sharing the
outer ragged axes (leading, named by the same letters, kept in the output) is
read as a batch of those axes' elements (``element_batch``: the sentences as
samples, zero copy), the one-level product runs on it, and its result goes back
under the outer axes (``under_outer``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .._axes import inner_layout, leading_levels, outer_layout, refuse_nested
from .._construct_nested import build_nested
from .._errors import fail
from .._index import lengths_of, offsets_of
from .._layout import Layout
from .._mixed import rectangle_sides
from .._nested import level_counts
from .._ragged import Ragged
from ._broadcast import check_equal


def _outer_letters(inputs: list[str], rhs: str, operands: Sequence[Ragged | Tensor]) -> int:
    """The number of outer ragged axes every ``Ragged`` operand leads with, under the
    same letters as the output's first sample axes."""
    raggeds = [
        (op, sub) for op, sub in zip(operands, inputs, strict=True) if isinstance(op, Ragged)
    ]
    limit = min(leading_levels(op) for op, _ in raggeds)
    m = 0
    while m < limit and 1 + m < len(rhs) and all(sub[1 + m] == rhs[1 + m] for _, sub in raggeds):
        m += 1
    return m


def element_batch(x: Ragged, outer: int) -> Ragged | Tensor:
    """The elements of ragged axis ``outer - 1`` of ``x`` as the samples of a value
    (their ragged axes one rectangle), or, with no ragged axis below, their rows as a
    dense ``[N, *dense]`` tensor (dense axes in logical order). Shares ``x.values``."""
    if outer == x.num_ragged:
        order = [1 + a.index for a in x.layout.axes if not a.ragged]
        return x.values.permute(0, *order)
    parts = [x.row_offsets[outer - 1]]  # element of axis outer - 1 -> its elements below
    for k in range(outer, x.num_ragged - 1):
        parts.append(x.row_offsets[k].index_select(0, parts[-1]))
    counts = torch.stack([lengths_of(p) for p in parts], 1)
    return Ragged(x.values, parts[-1], rectangle_sides(counts), inner_layout(x.layout, outer))


def _outer_lengths(x: Ragged, outer: int) -> list[Tensor]:
    return [x.sizes[:, 0], *(lengths_of(x.row_offsets[k]) for k in range(outer - 1))]


def under_outer(y: Ragged | Tensor, x: Ragged, outer: int, rows: Any = None) -> Ragged:
    """A per-element result ``y`` (batch: the elements of ragged axis ``outer - 1`` of
    ``x``) put back under ``x``'s outer ragged axes ``0 .. outer - 1``. ``rows``, where
    known from a shape, is the sum of ``y``'s first ragged side over its samples: the
    size of the second side's repeat, so that it needs no sync."""
    lengths = _outer_lengths(x, outer)
    if isinstance(y, Tensor):
        inner = Layout.standard(0, y.ndim - 1)
        values = y
    else:
        inner = y.layout
        sides = y.sizes
        lengths.append(sides[:, 0])  # one per sample of y
        count = sides[:, 0]
        for k in range(1, y.num_ragged):  # every element of the level above repeats the side
            first = y.layout.axes[0]  # rows counts the output's first inner axis
            size = rows if k == 1 and first.ragged and first.index == 0 else None
            lengths.append(sides[:, k].repeat_interleave(count, output_size=size))
            count = count * sides[:, k]
        values = y.values
    layout = outer_layout(x.layout, inner, outer)
    if len(lengths) == 1:
        return Ragged(values, offsets_of(lengths[0]), lengths[0].unsqueeze(1), layout)
    return build_nested(values, lengths, layout)


def per_element_einsum(
    fn: str,
    inputs: list[str],
    rhs: str,
    operands: Sequence[Ragged | Tensor],
    batched_dense: list[int],
    einsum: Callable[..., Any],
) -> Ragged | Tensor:
    """``einsum`` with nested operands, per element of their shared outer ragged axes."""
    outer = _outer_letters(inputs, rhs, operands)
    raggeds = [op for op in operands if isinstance(op, Ragged)]
    first = next(op for op in raggeds if op.row_offsets)
    fits = outer > 0 and not batched_dense
    for op in raggeds:
        below = [a for a in op.layout.axes if a.ragged and a.index > outer]
        fits = fits and not any(a.nested for a in below)
        fits = fits and (bool(op.row_offsets) or op.num_ragged == outer)
    if not fits:
        for op in raggeds:
            refuse_nested(
                fn,
                op,
                "products that combine or contract nested ragged axes other than per element "
                "of outer axes that lead every Ragged operand and the output under the same "
                "letters (with one rectangle of ragged axes below them, no batched dense "
                "operand)",
            )
    for n, op in enumerate(raggeds):
        explain = f"operand {n} differs in the outer ragged axes the product runs under"
        check_equal(fn, "sizes", op.sizes[:, :outer], first.sizes[:, :outer], explain)
        if op.batch_size != first.batch_size:
            raise fail(fn, f"operand {n} has {op.batch_size} samples, expected {first.batch_size}")
        for k in range(outer - 1):
            check_equal(fn, f"row_offsets[{k}]", op.row_offsets[k], first.row_offsets[k], explain)
    batch = rhs[0]
    subscripts = [
        batch + sub[1 + outer :] if isinstance(op, Ragged) else sub
        for op, sub in zip(operands, inputs, strict=True)
    ]
    demoted = [element_batch(op, outer) if isinstance(op, Ragged) else op for op in operands]
    equation = ",".join(subscripts) + "->" + batch + rhs[1 + outer :]
    return under_outer(
        einsum(equation, *demoted), first, outer, _first_side_rows(inputs, rhs, operands, outer)
    )


def _first_side_rows(
    inputs: list[str], rhs: str, operands: Sequence[Ragged | Tensor], outer: int
) -> Any:
    """The elements of the output's first inner axis across the batch, where an operand
    holds that letter as its ragged axis ``outer`` (a tensor shape: no sync), else None."""
    if len(rhs) <= 1 + outer:
        return None
    for op, sub in zip(operands, inputs, strict=True):
        if (
            isinstance(op, Ragged)
            and leading_levels(op) > outer
            and sub[1 + outer] == rhs[1 + outer]
        ):
            return level_counts(op.row_offsets, op.values.shape[0])[outer]
    return None
