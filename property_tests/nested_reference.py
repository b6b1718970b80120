"""Per-sample, per-row Python loops for nested ragged values.

A value is read into a canonical form by hand, from its raw partitions with
Python lists (no raggedfn index helper, conversion or op is used), so a bug in
raggedfn cannot hide the same bug here:

    Sample = (keys, rows)
    keys[k]: the coordinate tuple (c_0, ..., c_k) of every element of ragged
             level k of the sample, in packed order
    rows:    the logical row tensor ([*dense], dense axes in logical order) of
             every element of the innermost level, in packed order

Reducing a set of levels aligns the others by position (as padding would): an
output element is a tuple of kept coordinates that some input element has, and
its rows are the input rows with those kept coordinates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

import raggedfn
from raggedfn import Ragged

Sample = tuple[list[list[tuple[int, ...]]], list[Tensor]]


def canonical(x: Ragged) -> list[Sample]:
    """``x`` (nested, one-level, or a sample) in canonical form, by hand."""
    sizes = [[int(v) for v in row] for row in x.sizes.tolist()]
    offsets = [int(v) for v in x.offsets.tolist()]
    parts = [[int(v) for v in p.tolist()] for p in x.row_offsets]
    levels = x.layout.num_ragged
    if not parts and levels != 1:
        return _canonical_rectangles(x, sizes, offsets)
    dense_perm = [a.index for a in x.layout.axes if not a.ragged]
    out: list[Sample] = []
    first = 0  # global id of the sample's first level-0 element
    for i in range(len(sizes)):
        keys: list[list[tuple[int, ...]]] = [[(c,) for c in range(sizes[i][0])]]
        ids = list(range(first, first + sizes[i][0]))
        first += sizes[i][0]
        for k in range(1, levels):
            p = parts[k - 1]
            new_keys, new_ids = [], []
            for key, e in zip(keys[-1], ids, strict=True):
                for c, child in enumerate(range(p[e], p[e + 1])):
                    new_keys.append((*key, c))
                    new_ids.append(child)
            keys.append(new_keys)
            ids = new_ids
        if levels == 1:
            ids = list(range(offsets[i], offsets[i + 1]))
        assert ids == list(range(offsets[i], offsets[i + 1])), "rows of sample are not contiguous"
        rows = [x.values[r].permute(*dense_perm) if dense_perm else x.values[r] for r in ids]
        out.append((keys, rows))
    return out


def _canonical_rectangles(x: Ragged, sizes: list[list[int]], offsets: list[int]) -> list[Sample]:
    """Rectangular ragged axes (stored in logical order): the keys of level ``k`` are
    every coordinate tuple within the first ``k + 1`` sides, row-major."""
    if [a.index for a in x.layout.axes if a.ragged] != list(range(x.layout.num_ragged)):
        raise AssertionError("canonical() reads rectangles stored in logical order")
    dense_perm = [a.index for a in x.layout.axes if not a.ragged]
    out: list[Sample] = []
    for i, sides in enumerate(sizes):
        keys: list[list[tuple[int, ...]]] = [[(c,) for c in range(sides[0])]]
        for side in sides[1:]:
            keys.append([(*key, c) for key in keys[-1] for c in range(side)])
        ids = range(offsets[i], offsets[i + 1])
        assert len(ids) == len(keys[-1]), "rows of sample do not fill its rectangle"
        rows = [x.values[r].permute(*dense_perm) if dense_perm else x.values[r] for r in ids]
        out.append((keys, rows))
    return out


def dense_shape(x: Ragged) -> tuple[int, ...]:
    return tuple(x.values.shape[1 + a.index] for a in x.layout.axes if not a.ragged)


def stack(rows: Sequence[Tensor], shape: tuple[int, ...], like: Tensor) -> Tensor:
    return torch.stack(list(rows)) if rows else like.new_zeros((0, *shape))


def aligned(
    sample: Sample, reduce: Sequence[int]
) -> tuple[list[list[tuple[int, ...]]], list[list[int]]]:
    """Output element keys per kept level, and the input rows of every output row."""
    keys, _ = sample
    levels = len(keys)
    kept = [k for k in range(levels) if k not in reduce]
    out_keys = []
    for m, k in enumerate(kept):
        found = sorted({tuple(key[j] for j in kept[: m + 1]) for key in keys[k]})
        out_keys.append(found)
    if not kept:
        return [], [list(range(len(keys[-1])))]
    index = {key: n for n, key in enumerate(out_keys[-1])}
    members: list[list[int]] = [[] for _ in out_keys[-1]]
    last = kept[-1]
    for r, key in enumerate(keys[-1]):
        members[index[tuple(key[j] for j in kept if j <= last)]].append(r)
    return out_keys, members


def reduce(
    x: Ragged,
    levels: Sequence[int],
    op: Callable[[Tensor], Tensor],
) -> list[Sample | Tensor]:
    """Per sample: reduce nested ``levels`` (0-based); ``op`` takes the stacked member
    rows ``[n, *dense]`` (n may be 0) and reduces axis 0 (and any dense axes)."""
    shape, out = dense_shape(x), []
    for sample in canonical(x):
        out_keys, members = aligned(sample, levels)
        values = [op(stack([sample[1][r] for r in m], shape, x.values)) for m in members]
        out.append((out_keys, values) if out_keys else values[0])
    return out


def lines(x: Ragged, level: int, op: Callable[[Tensor], Tensor]) -> list[Sample]:
    """Per sample: ``op`` along the aligned lines of ``level`` (softmax, cumsum, ...);
    ``op`` maps ``[n, *dense]`` (rows in increasing coordinate) to the same shape."""
    shape, out = dense_shape(x), []
    for keys, rows in canonical(x):
        result: list[Tensor | None] = [None] * len(rows)
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, key in enumerate(keys[-1]):
            groups.setdefault(key[:level] + key[level + 1 :], []).append(r)
        for members in groups.values():
            mapped = op(stack([rows[r] for r in members], shape, x.values))
            for n, r in enumerate(members):
                result[r] = mapped[n]
        out.append((keys, [t for t in result if t is not None]))
    return out


def assert_canonical(got: Any, expected: list[Any], **tolerances: Any) -> None:
    """A result (``Ragged``, or dense ``[B, ...]``) equals the per-sample reference."""
    if isinstance(got, Ragged):
        raggedfn.check(got)  # the result keeps its promises (rectangles rectangular)
        samples = canonical(got)
        assert len(samples) == len(expected), (len(samples), len(expected))
        for i, ((keys, rows), (want_keys, want_rows)) in enumerate(
            zip(samples, expected, strict=True)
        ):
            assert keys == want_keys, f"sample {i}: structure {keys} != expected {want_keys}"
            for r, (g, e) in enumerate(zip(rows, want_rows, strict=True)):
                assert g.shape == e.shape, f"sample {i} row {r}: {g.shape} != {e.shape}"
                torch.testing.assert_close(
                    g,
                    e,
                    equal_nan=True,
                    msg=lambda m, i=i, r=r: f"sample {i} row {r}: {m}",
                    **tolerances,
                )
        return
    assert isinstance(got, Tensor), type(got)
    assert got.shape[0] == len(expected)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert isinstance(e, Tensor), f"sample {i}: expected a nested result, got a dense one"
        torch.testing.assert_close(
            g, e, equal_nan=True, msg=lambda m, i=i: f"sample {i}: {m}", **tolerances
        )


def weighted_sum(result: Any) -> Tensor:
    """A scalar of a result (or reference) that weighs every output element differently,
    so that gradients compare element by element."""
    if isinstance(result, Ragged):
        rows = [row for _, sample_rows in canonical(result) for row in sample_rows]
    elif isinstance(result, Tensor):
        rows = list(result.unbind(0)) if result.ndim else [result]
    else:
        rows = [row for item in result for row in (item[1] if isinstance(item, tuple) else [item])]
    total = torch.zeros((), dtype=torch.float64)
    for n, row in enumerate(rows):
        weights = torch.linspace(0.5, 1.5, row.numel(), dtype=torch.float64) * (1 + n % 3)
        total = (
            total
            + (
                torch.nan_to_num(row.to(torch.float64), posinf=0.0, neginf=0.0).reshape(-1)
                * weights
            ).sum()
        )
    return total
