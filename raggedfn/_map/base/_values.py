"""Batched values inside the ``map`` interpreter and the helpers that move them.

Every graph value is one of:

- a plain tensor / Python value: the same for every sample (unbatched);
- :class:`DenseB`: ``data [B, *shape]``, a fixed per-sample shape;
- :class:`RaggedB`: packed ``values [T, *dense]`` with a :class:`Layout` and one
  :class:`Sz` per ragged axis (the traced size expression of that axis);
- :class:`SymB`: a per-sample integer (a traced symbolic size such as ``s0``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..._index import local_positions, offsets_of, segment_ids
from ..._layout import Layout

# re-exported: the layout helpers live in ._layouts
from ._layouts import (
    LayoutInfo as LayoutInfo,
)
from ._layouts import (
    axes_of as axes_of,
)
from ._layouts import (
    info_of as info_of,
)
from ._layouts import (
    make_layout as make_layout,
)
from ._layouts import (
    num_dense_of as num_dense_of,
)
from ._layouts import (
    num_ragged_of as num_ragged_of,
)
from ._sizes import Env, Sz, Unsupported, product_key


class Struct:
    """Partitions of one ragged shape (a tuple of :class:`Sz`): sizes, offsets, index tensors."""

    def __init__(self, sizes: Tensor, offsets: Tensor, total: Any) -> None:
        self.sizes = sizes
        self.offsets = offsets
        self.total = total
        self._segments: Tensor | None = None
        self._coords: list[Tensor] | None = None

    def segments(self) -> Tensor:
        if self._segments is None:
            self._segments = segment_ids(self.offsets, self.total)
        return self._segments

    def coords(self) -> list[Tensor]:
        """Coordinate of every packed row along each ragged axis (storage order)."""
        if self._coords is None:
            segments = self.segments()
            rest = local_positions(self.offsets, segments, self.total)
            num = self.sizes.shape[1]
            coords = [rest] * num
            for k in range(num - 1, 0, -1):
                size_k = take_rows(self.sizes[:, k], segments)
                coords[k] = torch.remainder(rest, size_k)
                rest = torch.div(rest, size_k, rounding_mode="floor")
            if num:
                coords[0] = rest
            self._coords = coords
        return self._coords


class DenseB:
    __slots__ = ("data",)

    def __init__(self, data: Tensor) -> None:
        self.data = data


class SymB:
    __slots__ = ("sz",)

    def __init__(self, sz: Sz) -> None:
        self.sz = sz


class RaggedB:
    __slots__ = ("layout", "struct", "sz", "values")

    def __init__(self, values: Tensor, layout: Layout, sz: tuple[Sz, ...], struct: Struct) -> None:
        self.values = values
        self.layout = layout
        self.sz = sz
        self.struct = struct

    def shape(self) -> tuple[Any, ...]:
        """Logical per-sample shape: ints for dense axes, :class:`Sz` for ragged ones."""
        dense = self.values.shape[1:]
        return tuple(self.sz[a.index] if a.ragged else dense[a.index] for a in axes_of(self.layout))

    def positions(self) -> tuple[int, ...]:
        return tuple(p for p, _ in info_of(self.layout).ragged)


BATCHED = (DenseB, RaggedB, SymB)


def is_batched(value: Any) -> bool:
    return isinstance(value, BATCHED)


class Ctx:
    """Per-call state: batch size, the symbol environment and cached partitions."""

    def __init__(self, batch_size: int, env: Env, totals: dict[str, Any], device: Any) -> None:
        self.batch_size = batch_size
        self.env = env
        self.totals = totals
        self.device = device
        self.structs: dict[tuple[str, ...], Struct] = {}
        self.paths: dict[str, int] | None = None  # attention paths taken, for map_report
        self.lifted: list[Any] = []  # tensors f captures, read at this call
        self.randomness = "different"
        self.tiles = False  # run row-local chains on row tiles (see _tiles.py)

    def eval(self, sz: Sz | int) -> Tensor:
        """``[B]`` int64 values of a size."""
        if isinstance(sz, int):
            return torch.full((self.batch_size,), sz, dtype=torch.int64, device=self.device)
        value = sz.fn(self.env)
        if not isinstance(value, Tensor):
            value = torch.full((self.batch_size,), value, device=self.device)
        return value

    def struct(self, sz: tuple[Sz, ...]) -> Struct:
        key = tuple(s.key for s in sz)
        found = self.structs.get(key)
        if found is not None:
            return found
        if sz:
            # a traced size such as s0 - 1 (from x[1:]) assumes s0 >= 1; the sample has max(., 0)
            sizes = torch.stack([self.eval(s).to(torch.int64).clamp(min=0) for s in sz], 1)
            counts = sizes.prod(dim=1)
        else:
            sizes = torch.zeros(self.batch_size, 0, dtype=torch.int64, device=self.device)
            counts = torch.ones(self.batch_size, dtype=torch.int64, device=self.device)
        offsets = offsets_of(counts)
        pkey = product_key(sz)
        total = self.totals.get(pkey)
        if total is None:
            if torch.compiler.is_compiling():
                # an unbacked symbol in a graph (torch.export, or torch.compile with
                # capture_scalar_outputs); int() would guard on the example's value
                total = offsets[-1].item()
                torch._check(total >= 0)
            else:
                total = int(offsets[-1])  # host sync: a new packed size (e.g. pairs from tokens)
            self.totals[pkey] = total
        out = Struct(sizes, offsets, total)
        self.structs[key] = out
        return out


# ----- rows and alignment ---------------------------------------------------------


def ragged_positions(shape: tuple[Any, ...]) -> tuple[int, ...]:
    """Positions of the ragged axes (``Sz`` sizes) in a per-sample ``shape``."""
    return tuple(p for p, s in enumerate(shape) if isinstance(s, Sz))


def rank_of(x: Any) -> int:
    """Per-sample rank of a batched tensor value (``Unsupported`` for a per-sample size)."""
    if isinstance(x, DenseB):
        return x.data.ndim - 1
    if isinstance(x, RaggedB):
        return len(axes_of(x.layout))
    raise Unsupported("not a tensor")


def take_rows(values: Tensor, rows: Tensor) -> Tensor:
    """``values[rows]``: for a 1-D ``rows`` one ``index_select``, several times faster
    than advanced indexing on CPU, and its backward is an ``index_add`` rather than
    the sorting ``index_put`` of ``values[rows]``."""
    if rows.ndim == 1:
        return values.index_select(0, rows)
    picked = values.index_select(0, rows.reshape(-1))
    return picked.reshape(*rows.shape, *values.shape[1:])


def rows_of(x: RaggedB, segments: Tensor, coords: list[Any]) -> Tensor:
    """Packed row of ``x`` at sample ``segments`` and ragged coordinates ``coords`` (k order)."""
    return struct_rows(x.struct, segments, coords)


def struct_rows(struct: Struct, segments: Tensor, coords: list[Any]) -> Tensor:
    """Packed row at sample ``segments`` and ragged coordinates ``coords`` (storage order)."""
    sizes = struct.sizes
    row = None
    for k, c in enumerate(coords):
        row = c if row is None else row * take_rows(sizes[:, k], segments) + c
    start = take_rows(struct.offsets, segments)
    return start if row is None else start + row


_CANONICAL: dict[tuple[int, tuple[int, ...]], Layout] = {}


def canonical_layout(rank: int, positions: tuple[int, ...]) -> Layout:
    """Ragged axes numbered in logical order, dense axes likewise (cached)."""
    if torch.compiler.is_compiling():  # no memo (see info_of)
        return Layout.from_ragged_positions(rank, positions)
    key = (rank, tuple(positions))
    found = _CANONICAL.get(key)
    if found is None:
        found = Layout.from_ragged_positions(rank, positions)
        _CANONICAL[key] = found
    return found


def canonicalize(ctx: Ctx, x: RaggedB) -> RaggedB:
    """The same value with ragged axes stored in logical order and dense axes in logical order."""
    positions = x.positions()
    target = canonical_layout(len(axes_of(x.layout)), positions)
    if x.layout == target:
        return x
    ragged_order = [a.index for a in axes_of(x.layout) if a.ragged]
    dense_order = [a.index for a in axes_of(x.layout) if not a.ragged]
    values, sz, struct = x.values, x.sz, x.struct
    if ragged_order != sorted(ragged_order):
        sz = tuple(x.sz[k] for k in ragged_order)
        struct = ctx.struct(sz)
        out_coords = struct.coords()
        coords: list[Any] = [None] * len(ragged_order)
        for new_k, old_k in enumerate(ragged_order):
            coords[old_k] = out_coords[new_k]
        values = take_rows(values, rows_of(x, struct.segments(), coords))
    if dense_order != sorted(dense_order):
        values = values.permute(0, *(1 + j for j in dense_order))
    return RaggedB(values, target, sz, struct)


def _place_dense(t: Tensor, have: Sequence[int], want: Sequence[int]) -> Tensor:
    """``t [T, *dims at logical positions have]`` as ``[T, *want]``, 1 where missing."""
    order = [have.index(p) for p in want if p in have]
    t = t.permute(0, *(1 + i for i in order)) if order != sorted(order) else t
    present = [p for p in want if p in have]
    shape = [t.shape[0]]
    it = iter(t.shape[1:])
    for p in want:
        shape.append(next(it) if p in present else 1)
    return t.reshape(shape)


def align(
    ctx: Ctx, operand: Any, shape: tuple[Any, ...], layout: Layout, struct: Struct | None
) -> Any:
    """``operand`` broadcast (as torch would) to a batched value of logical ``shape``.

    Returns a tensor laid out like the result's packed values: ``[T, *dense]`` in
    the dense storage order of ``layout`` (``[B, *dense]`` when ``struct`` is None,
    i.e. the result has no ragged axis), with size-1 axes where ``operand``
    broadcasts; an unbatched operand that is the same for every row comes back
    with a leading axis of 1 (torch broadcasts it, no copy per row). Python
    scalars and 0-d unbatched tensors pass through.
    """
    if isinstance(operand, RaggedB):
        return _align_ragged(ctx, operand, shape, layout, struct)
    if isinstance(operand, SymB):
        operand = DenseB(ctx.eval(operand.sz))
    n = len(shape)
    if isinstance(operand, Tensor):
        if operand.ndim == 0:
            return operand
        t = operand.reshape((1,) * (n - operand.ndim) + tuple(operand.shape))
        t = t.reshape(1, *t.shape)
    elif isinstance(operand, DenseB):
        data = operand.data
        m = data.ndim - 1
        t = data.reshape(data.shape[0], *((1,) * (n - m)), *data.shape[1:])
    else:
        return operand
    # t: [1 or B, *logical n dims]
    info = info_of(layout)
    ragged_pos = info.ragged_at
    want = info.dense_pos
    keep = [p for p in range(n) if p not in ragged_pos]
    if struct is None or (
        isinstance(operand, Tensor) and all(t.shape[1 + p] == 1 for p in ragged_pos)
    ):
        # no ragged result axis, or the same operand for every row: no gather
        for p in ragged_pos:
            if t.shape[1 + p] != 1:
                raise Unsupported("a fixed-size operand broadcast along a ragged axis")
        t = t.reshape(t.shape[0], *(t.shape[1 + p] for p in keep))
        return _place_dense(t, keep, want)
    segments = struct.segments()
    batch_index = segments if isinstance(operand, DenseB) else torch.zeros_like(segments)
    index: list[Any] = [batch_index]
    coords = None
    for p in range(n):
        if p not in ragged_pos:
            index.append(slice(None))
        elif t.shape[1 + p] == 1:
            index.append(torch.zeros_like(segments))
        elif isinstance(shape[p], Sz) and shape[p].const == t.shape[1 + p]:
            coords = coords if coords is not None else struct.coords()
            index.append(coords[ragged_pos[p]])
        else:
            raise Unsupported("a fixed-size operand broadcast along a ragged axis")
    t = t[tuple(index)]
    return _place_dense(t, keep, want)


def _align_ragged(
    ctx: Ctx, x: RaggedB, shape: tuple[Any, ...], layout: Layout, struct: Struct | None
) -> Tensor:
    if struct is None and any(type(s) is int and s == 0 for s in shape):
        # a result without elements (a plan for empty samples fixes their size to 0):
        # only the operand's shape matters, not which rows it would read
        n = len(shape)
        # (a view of none of x's elements: it keeps x's autograd history)
        empty = x.values.reshape(-1)[:0].reshape(ctx.batch_size, *shape)
        return _place_dense(empty, list(range(n)), info_of(layout).dense_pos)
    xinfo = info_of(x.layout)
    if struct is None and len(xinfo.ragged) == 1:
        # the result has no ragged axis: torch broadcast x's one ragged axis against a
        # fixed size, which a guard of this plan decided (s == c or s == 1) for every
        # sample alike, so the samples' rows are equally many: x as a fixed-size value
        p = xinfo.ragged[0][0]
        t = x.values.reshape(x.struct.sizes.shape[0], -1, *x.values.shape[1:])
        have = [p, *xinfo.dense_pos]
        perm = sorted(range(len(have)), key=have.__getitem__)
        return align(ctx, DenseB(t.permute(0, *(1 + i for i in perm))), shape, layout, None)
    rows, finish = ragged_alignment(ctx, x, shape, layout, struct)
    return finish(x.values if rows is None else take_rows(x.values, rows))


def ragged_alignment(
    ctx: Ctx, x: RaggedB, shape: tuple[Any, ...], layout: Layout, struct: Struct | None
) -> tuple[Tensor | None, Any]:
    """How :func:`align` lays a ragged ``x`` out like a result of logical ``shape``:
    ``(rows, finish)``, where the aligned values are ``finish(x.values[rows])`` (``rows``
    None: ``finish(x.values)``). Row tiles gather a tile's slice of ``rows`` only."""
    if struct is None:
        raise Unsupported("a ragged operand in an op whose result has no ragged axis")
    info = info_of(layout)
    if x.struct is struct and x.layout.code == layout.code:
        # the result's own layout and rows: its values as they are, when every ragged
        # axis carries the result's size (the general path below checks the same)
        sz = x.sz
        for p, k in info.ragged:
            s = shape[p]
            if not isinstance(s, Sz) or s.key != sz[k].key:
                break
        else:
            return None, _same
    n = len(shape)
    xinfo = info_of(x.layout)
    xaxes = xinfo.axes
    shift = n - len(xaxes)
    out_k = info.ragged_at
    coords: list[Any] = [None] * len(xinfo.ragged)
    identity = True
    for q, k in xinfo.ragged:
        p = q + shift
        if p not in out_k or not isinstance(shape[p], Sz) or shape[p].key != x.sz[k].key:
            raise Unsupported("a ragged axis that does not line up with the result")
        coords[k] = out_k[p]
        identity = identity and out_k[p] == k
    rows = None
    same_struct = identity and len(coords) == len(out_k) and x.struct is struct
    if not same_struct:
        out_coords = struct.coords()
        if len(coords) == 0:
            rows = struct.segments()  # a ragged value without ragged axes: never
        else:
            rows = rows_of(x, struct.segments(), [out_coords[c] for c in coords])
    # dense axes of x: values dim 1 + j sits at logical position q + shift
    have_pos = [q + shift for q in xinfo.dense_pos]
    # dense axes of x at ragged result positions have size 1: drop them
    drop = [j for j, p in enumerate(have_pos) if p in out_k]
    dense = x.values.shape[1:]
    keep = list(range(len(have_pos)))
    if drop:
        for j in drop:
            if dense[j] != 1:
                raise Unsupported("a fixed-size axis broadcast along a ragged axis")
        keep = [j for j in keep if j not in drop]
        have_pos = [have_pos[j] for j in keep]
    want = info.dense_pos

    def finish(values: Tensor) -> Tensor:
        if drop:
            values = values.reshape(values.shape[0], *(values.shape[1 + j] for j in keep))
        return _place_dense(values, have_pos, want)

    return rows, finish


def _same(values: Tensor) -> Tensor:
    return values


def out_layout_for(shape: tuple[Any, ...], operands: list[Any]) -> Layout:
    """Layout of a result of logical ``shape``: that of a full-shape ragged operand if any."""
    for x in operands:
        if isinstance(x, RaggedB) and lines_up(x, shape):
            return x.layout
    return canonical_layout(len(shape), tuple(p for p, s in enumerate(shape) if isinstance(s, Sz)))


def lines_up(x: RaggedB, shape: tuple[Any, ...]) -> bool:
    """``x`` has the rank of ``shape``, ragged exactly where ``shape`` has a size of its own,
    with the same size there."""
    axes = info_of(x.layout).axes
    if len(axes) != len(shape):
        return False
    for s, a in zip(shape, axes, strict=True):
        mine = x.sz[a.index] if a.ragged else None
        if isinstance(s, Sz):
            if not isinstance(mine, Sz) or mine.key != s.key:
                return False
        elif isinstance(mine, Sz):
            return False
    return True


def sz_in_storage_order(shape: tuple[Any, ...], layout: Layout) -> tuple[Sz, ...]:
    ragged = info_of(layout).ragged
    out: list[Any] = [None] * len(ragged)
    for p, k in ragged:
        out[k] = shape[p]
    return tuple(out)


def make_ragged(ctx: Ctx, values: Tensor, shape: tuple[Any, ...], layout: Layout) -> RaggedB:
    sz = sz_in_storage_order(shape, layout)
    return RaggedB(values, layout, sz, ctx.struct(sz))


def dense_shape(shape: tuple[Any, ...], layout: Layout) -> list[int]:
    return [shape[p] for p in info_of(layout).dense_pos]


def reduce_index(ctx: Ctx, x: RaggedB, reduced: set[int]) -> tuple[Tensor, Any, tuple[Sz, ...]]:
    """For reducing ragged axes ``reduced`` (storage k) of canonical ``x``: each row's
    target row, the number of targets, and the remaining sizes."""
    keep = [k for k in range(num_ragged_of(x.layout)) if k not in reduced]
    segments = x.struct.segments()
    if not keep:
        return segments, ctx.batch_size, ()
    sz = tuple(x.sz[k] for k in keep)
    out = ctx.struct(sz)
    coords = x.struct.coords()
    row = coords[keep[0]]
    for i, k in enumerate(keep[1:], start=1):
        row = row * take_rows(out.sizes[:, i], segments) + coords[k]
    return take_rows(out.offsets, segments) + row, out.total, sz
