"""Running a call in parts: samples grouped by the trace whose guards they meet.

When some samples fail a plan's guards (a branch on sizes, an index past the
end of a short sample), the batch is split: each group of samples runs the plan
it satisfies, the rest run the per-sample loop, and the parts are merged back
in sample order. A leaf's type follows f's first trace: ragged where that trace
says so or where the samples' sizes differ, else a dense ``[B, ...]`` tensor.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ..._construct import from_list, unbind
from ..._errors import fail
from ..._index import offsets_of
from ..._layout import Layout
from ..._ragged import Ragged
from ..base._sizes import Sz
from ..base._steps import TSpec


def take(value: Any, index: Tensor) -> Any:
    """Samples ``index`` (int64 ``[b]``) of a mapped input, in that order."""
    if isinstance(value, Ragged):
        return take_samples(value, index)
    if isinstance(value, Tensor):
        return value.index_select(0, index)
    return value


def take_samples(x: Ragged, index: Tensor) -> Ragged:
    """The samples ``index`` of ``x`` as a new value (one host sync for the row count)."""
    index = index.to(x.offsets.device)
    starts = x.offsets[:-1].index_select(0, index)
    counts = x.offsets[1:].index_select(0, index) - starts
    offsets = offsets_of(counts)
    total = int(offsets[-1])
    sample = torch.repeat_interleave(
        torch.arange(index.shape[0], device=index.device), counts, output_size=total
    )
    rows = starts.index_select(0, sample) + (
        torch.arange(total, device=index.device) - offsets.index_select(0, sample)
    )
    return Ragged._make(
        x.values.index_select(0, rows), offsets, x.sizes.index_select(0, index), x.layout
    )


def _dense_as_ragged(t: Tensor, like: Ragged | None, layout: Layout | None = None) -> Ragged:
    """``[b, *shape]`` as a Ragged with ``like``'s layout (every sample the same sizes)."""
    layout = like.layout if like is not None else layout
    assert layout is not None
    shape = tuple(t.shape[1:])
    if len(shape) != len(layout.axes):
        raise fail(
            "map",
            f"f returns per-sample shapes of different ranks: {shape} in some samples, rank "
            f"{len(layout.axes)} (ragged) in others",
        )
    ragged = [shape[p] for p, a in enumerate(layout.axes) if a.ragged]
    dense_shape = [0] * layout.num_dense
    for p, a in enumerate(layout.axes):
        if not a.ragged:
            dense_shape[a.index] = shape[p]
    if like is not None and tuple(dense_shape) != tuple(like.values.shape[1:]):
        raise fail(
            "map",
            f"f returns per-sample shapes that differ along a fixed-size axis: {shape} in some "
            f"samples, logical shape {like.shape[1:]} in others",
        )
    b = t.shape[0]
    sizes = torch.tensor(ragged, dtype=torch.int64, device=t.device).repeat(b, 1)
    count = math.prod(ragged)
    physical = layout.logical_to_physical()
    values = t.permute(0, *(1 + p for p in physical)).reshape(b * count, *dense_shape)
    offsets = offsets_of(torch.full((b,), count, dtype=torch.int64, device=sizes.device))
    return Ragged._make(values, offsets, sizes.reshape(b, len(ragged)), layout)


def _standard(x: Ragged, layout: Layout) -> Ragged:
    if x.layout == layout:
        return x
    from ...ops import contiguous

    out = contiguous(x)
    if out.layout != layout:
        raise fail("map", "f returns values with different ragged axes in different samples")
    return out


def _ragged_positions(v: Ragged) -> set[int]:
    return {p for p, a in enumerate(v.layout.axes) if a.ragged}


def _sizes_at(v: Tensor | Ragged) -> list[int | None]:
    """Per logical axis: its size when the same for every sample of ``v``, else None."""
    if isinstance(v, Tensor):
        return list(v.shape[1:])
    out: list[int | None] = []
    for a in v.layout.axes:
        if not a.ragged:
            out.append(int(v.values.shape[1 + a.index]))
            continue
        column = v.sizes[:, a.index]
        if not column.numel():  # no samples: no size to tell
            out.append(None)
            continue
        low, high = int(column.min()), int(column.max())
        out.append(low if low == high else None)
    return out


def _as_dense(v: Tensor | Ragged) -> Tensor:
    """A part whose samples all have one shape as a ``[b, ...]`` tensor."""
    if isinstance(v, Tensor):
        return v
    return torch.stack(list(unbind(v)))


def merge(parts: list[tuple[Tensor, Any]], batch_size: int, ragged: tuple[int, ...] = ()) -> Any:
    """One output leaf from its parts ``(sample indices, leaf for those samples)``.

    A per-sample axis is ragged in the result when it is in ``ragged`` (the output
    structure f's first trace gives) or when its size differs between samples;
    else the parts join as a dense ``[B, ...]`` tensor, whatever type the plan
    of each part gave (a later plan, traced on a special size, may see a ragged
    axis where the first trace saw a fixed size: ``t[:1]`` under ``n > 3`` and
    under ``n <= 3``).
    """
    if any(len(i) for i, _ in parts):  # parts of no samples say nothing about sizes
        parts = [(i, v) for i, v in parts if len(i)]
    values = [v for _, v in parts]
    order = torch.cat([i for i, _ in parts])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0], device=order.device)
    tensors = [isinstance(v, (Tensor, Ragged)) for v in values]
    if not any(tensors):
        if all(v == values[0] for v in values):
            return values[0]
        raise fail("map", f"f returns different non-tensor values in different samples: {values}")
    if not all(tensors):
        raise fail("map", "f returns a tensor in some samples and a number in others")
    sizes = [_sizes_at(v) for v in values]
    ranks = {len(s) for s in sizes}
    if len(ranks) != 1:
        raise fail("map", f"f returns per-sample values of different ranks {sorted(ranks)}")
    rank = ranks.pop()
    positions = set(ragged)
    for p in range(rank):
        seen = {s[p] for s in sizes}
        if None in seen or len(seen) > 1:
            positions.add(p)
    if not positions:
        return torch.cat([_as_dense(v) for v in values]).index_select(0, inverse)
    layout = Layout.from_ragged_positions(rank, tuple(sorted(positions)))
    pieces = []
    for v in values:
        if isinstance(v, Tensor):
            pieces.append(_dense_as_ragged(v, None, layout))
        elif _ragged_positions(v) == positions:
            pieces.append(_standard(v, layout))
        elif not v.batch_size:  # no samples to rebuild from: an empty value of the layout
            shape = [0 if n is None else n for n in _sizes_at(v)]
            pieces.append(_dense_as_ragged(v.values.new_empty(0, *shape), None, layout))
        else:  # a part with other ragged axes (rare): rebuilt from its samples
            pieces.append(
                from_list(list(unbind(v)), ragged_dims=tuple(1 + p for p in sorted(positions)))
            )
    dense = {tuple(p.values.shape[1:]) for p in pieces}
    if len(dense) != 1:
        raise fail("map", "f returns per-sample values whose fixed-size axes differ")
    lengths = torch.cat([p.offsets[1:] - p.offsets[:-1] for p in pieces])
    joined = Ragged._make(
        torch.cat([p.values for p in pieces]),
        offsets_of(lengths),
        torch.cat([p.sizes for p in pieces]),
        pieces[0].layout,
    )
    return take_samples(joined, inverse)


def as_structure(out: Any, structure: list[tuple[int, ...]] | None) -> Any:
    """A plan's outputs with the ragged axes of the output structure, read from shapes
    only (no host sync: compiled code): a dense ``[B, ...]`` leaf of an output with
    ragged axes becomes a ``Ragged`` whose samples share its fixed sizes, as
    :func:`merge` makes it eagerly, and so do the fixed axes of a ``Ragged`` leaf that
    follow all its ragged ones (``(N, 3)`` as ``(N, M)``); other such leaves are
    refused."""
    flat, spec = pytree.tree_flatten(out, is_leaf=lambda v: isinstance(v, Ragged))
    if structure is None or len(structure) != len(flat):
        return out
    converted = []
    for leaf, ragged in zip(flat, structure, strict=True):
        if ragged and isinstance(leaf, Tensor) and leaf.ndim - 1 > max(ragged):
            layout = Layout.from_ragged_positions(leaf.ndim - 1, ragged)
            leaf = _dense_as_ragged(leaf, None, layout)
        elif ragged and isinstance(leaf, Ragged) and not set(ragged) <= _ragged_positions(leaf):
            leaf = _trailing_as_ragged(leaf, set(ragged))
        converted.append(leaf)
    return pytree.tree_unflatten(converted, spec)


def _trailing_as_ragged(x: Ragged, positions: set[int]) -> Ragged:
    """``x`` with its fixed axes at ``positions`` ragged (every sample the same size
    there), from shapes alone: only where they follow every ragged axis of ``x`` in a
    standard layout, so that each packed row becomes a run of rows."""
    have = _ragged_positions(x)
    new = sorted(positions - have)
    rank = x.layout.rank
    if (
        x.row_offsets
        or x.layout != Layout.from_ragged_positions(rank, tuple(sorted(have)))
        or min(new) < max(have)
    ):
        raise fail(
            "map",
            "inside torch.compile, an output of f has ragged axes the plan for these "
            "sizes gives a fixed size; run this call eagerly",
        )
    moved = [x.layout.axes[p].index for p in new]
    kept = [j for j in range(x.layout.num_dense) if j not in moved]
    values = x.values.permute(0, *(1 + j for j in moved), *(1 + j for j in kept))
    sides = [x.values.shape[1 + j] for j in moved]
    count = math.prod(sides)
    values = values.reshape(x.values.shape[0] * count, *(x.values.shape[1 + j] for j in kept))
    added = torch.tensor(sides, dtype=x.sizes.dtype, device=x.sizes.device)
    sizes = torch.cat([x.sizes, added.expand(x.sizes.shape[0], len(sides))], dim=1)
    layout = Layout.from_ragged_positions(rank, tuple(sorted(positions | have)))
    return Ragged._make(values, x.offsets * count, sizes, layout)


def empty_result(
    specs: list[Any], out_spec: Any, structure: list[tuple[int, ...]] | None, device: Any
) -> Any:
    """f's outputs for a batch of no samples, from a complete trace's output specs
    (None when an output is not a tensor of f's own: its type is unknown)."""
    if structure is None or len(structure) != len(specs):
        return None
    flat: list[Any] = []
    for spec, ragged in zip(specs, structure, strict=True):
        if not isinstance(spec, TSpec):
            return None
        positions = set(ragged) | set(ragged_positions_of(spec))
        fixed = [s if isinstance(s, int) else 0 for s in spec.shape]
        if not positions:
            flat.append(torch.empty(0, *fixed, dtype=spec.dtype, device=device))
            continue
        layout = Layout.from_ragged_positions(len(fixed), tuple(sorted(positions)))
        dense = [0] * layout.num_dense
        for p, a in enumerate(layout.axes):
            if not a.ragged:
                dense[a.index] = fixed[p]
        flat.append(
            Ragged._make(
                torch.empty(0, *dense, dtype=spec.dtype, device=device),
                torch.zeros(1, dtype=torch.int64, device=device),
                torch.zeros(0, len(positions), dtype=torch.int64, device=device),
                layout,
            )
        )
    return pytree.tree_unflatten(flat, out_spec)


def empty_samples(
    leaves: list[Any], kinds: list[str], batch_size: int, device: Any
) -> torch.Tensor:
    """``[B]`` bool: samples in which every mapped Ragged has no elements."""
    empty = torch.ones(batch_size, dtype=torch.bool, device=device)
    for leaf, kind in zip(leaves, kinds, strict=True):
        if kind == "ragged":
            empty &= (leaf.offsets[1:] == leaf.offsets[:-1]).to(device)
        elif kind == "dense" and math.prod(leaf.shape[1:]) > 0:
            empty &= False
    return empty


def ragged_positions_of(spec: Any) -> tuple[int, ...]:
    """The ragged per-sample axes of a traced output spec (none for other outputs)."""
    if not isinstance(spec, TSpec):
        return ()
    return tuple(p for p, s in enumerate(spec.shape) if isinstance(s, Sz))


__all__ = [
    "as_structure",
    "empty_result",
    "empty_samples",
    "merge",
    "ragged_positions_of",
    "take",
    "take_samples",
]
