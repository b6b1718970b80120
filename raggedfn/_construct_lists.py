"""``from_list`` of nested lists and of ``Ragged`` samples: one nesting level deeper.

Lists of tensors give nested ragged axes (documents -> sentences -> tokens); the
tensors themselves may have several ragged axes (a sentence's ``L x L`` pair
state), which form one rectangle in the innermost level. A list of ``Ragged``
samples stacks them as they are: every level of each sample becomes a level of
the result, its rectangles stay rectangles (``raggedfn._mixed``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._construct_nested import build_nested, check_rectangles, mixed_layout
from ._errors import describe, fail, shape_text
from ._index import lengths_of
from ._layout import Axis, Layout
from ._ragged import Ragged


def level_lengths(x: Ragged) -> list[Tensor]:
    """The per-element lengths of every ragged axis of ``x`` in chain form: axis 0 per
    sample, axis ``k`` once per element of axis ``k - 1`` (rectangles repeat a side)."""
    if x.row_offsets:
        return [x.sizes[:, 0], *(lengths_of(p) for p in x.row_offsets)]
    out = [x.sizes[:, 0]]
    for k in range(1, x.num_ragged):
        count = x.sizes[:, :k].prod(dim=1)
        out.append(torch.repeat_interleave(x.sizes[:, k], count))
    return out


def _check_sides(fn: str, where: str, sides: Sequence[int]) -> None:
    """Refuse a rectangle empty along one ragged axis but not along a later one: a
    nested value keeps no side after an empty one (``0 x 5`` would read back ``0 x 0``)."""
    for k in range(1, len(sides)):
        if math.prod(sides[:k]) == 0 and sides[k] != 0:
            raise fail(
                fn,
                f"{where} has ragged sizes {list(sides)}: inside a nested value a rectangle "
                "that is empty along one ragged axis must have size 0 along the later ones "
                "(nothing would keep their sizes)",
            )


def _same_dtype_and_device(fn: str, what: str, n: int, t: Tensor, first: Tensor) -> None:
    if t.dtype != first.dtype or t.device != first.device:
        raise fail(
            fn,
            f"{what} {n} is {t.dtype} on {t.device}, expected {first.dtype} on "
            f"{first.device} like {what} 0",
        )


def stack_samples(fn: str, samples: Sequence[Ragged]) -> Ragged:
    """``B`` ``Ragged`` samples as one value with one nesting level more: the samples'
    batch axis becomes a ragged axis nested in the new batch axis."""
    first = samples[0]
    for n, s in enumerate(samples):
        if s.layout != first.layout or s.values.shape[1:] != first.values.shape[1:]:
            raise fail(
                fn,
                f"Ragged sample {n} has logical shape {shape_text(s.shape)} and layout "
                f"{s.layout.code!r}, expected {shape_text(first.shape)} and "
                f"{first.layout.code!r} like sample 0",
            )
        _same_dtype_and_device(fn, "Ragged sample", n, s.values, first.values)
    if first.num_ragged > 1 and not first.row_offsets:
        for n, s in enumerate(samples):
            counts = s.sizes.prod(dim=1)
            later = s.sizes[:, 1:].ne(0).any(dim=1) & (counts == 0)
            if bool(later.any()):
                bad = int(later.nonzero()[0, 0])
                _check_sides(fn, f"Ragged sample {n}, element {bad},", s.sizes[bad].tolist())
    per_sample = [level_lengths(s) for s in samples]
    device = first.device
    lengths = [torch.tensor([s.batch_size for s in samples], dtype=torch.int64, device=device)]
    for k in range(first.num_ragged):
        lengths.append(torch.cat([levels[k] for levels in per_sample]))
    values = torch.cat([s.values for s in samples])
    # the samples' batch axis is nested in the new one; their axes keep their letters
    axes = [Axis(True, 0, False)]
    for a in first.layout.axes:
        if a.ragged:
            axes.append(Axis(True, a.index + 1, a.index == 0 or a.nested))
        else:
            axes.append(a)
    return build_nested(values, lengths, Layout(tuple(axes)))


def _leaf_depth(fn: str, item: Any, depth: int) -> int | None:
    """How many list levels lie above the first tensor found in ``item`` (None: none)."""
    if isinstance(item, Tensor):
        return depth
    if isinstance(item, Ragged):  # a list of its samples (one per group of its axes)
        return depth + 1 + item.layout.code.count("n")
    if isinstance(item, (list, tuple)):
        for child in item:
            found = _leaf_depth(fn, child, depth + 1)
            if found is not None:
                return found
        return None
    raise fail(fn, f"expected tensors or lists of tensors, got {describe(item)}")


def _as_lists(item: Any) -> Any:
    """``item`` with every ``Ragged`` in it, at any list level, as nested lists of
    tensors (its own samples)."""
    if isinstance(item, Ragged):
        return [_as_lists(item[i]) for i in range(item.batch_size)]
    if isinstance(item, (list, tuple)):
        children = [_as_lists(child) for child in item]
        return children if isinstance(item, list) else tuple(children)  # errors name it
    return item


def _first_ragged(item: Any) -> Ragged | None:
    """The first ``Ragged`` in ``item`` (a sample or a list of them, at any depth)."""
    if isinstance(item, Ragged):
        return item
    if isinstance(item, (list, tuple)):
        for child in item:
            found = _first_ragged(child)
            if found is not None:
                return found
    return None


def _tensor_axes(fn: str, ragged_dims: Any, depth: int, rank: int) -> tuple[int, ...]:
    """The ragged axes of the innermost tensors (0-based), from the batched logical
    ``ragged_dims`` of a value whose list levels are logical axes ``1 .. depth - 1``."""
    if ragged_dims is None:
        return (0,)
    dims = (ragged_dims,) if isinstance(ragged_dims, int) else tuple(ragged_dims)
    lists = tuple(range(1, depth))
    if tuple(sorted(dims))[: depth - 1] != lists or len(set(dims)) != len(dims):
        raise fail(
            fn,
            f"lists of tensors give nested ragged axes {list(lists)} (one per list level); "
            f"ragged_dims {ragged_dims!r} must name them and then the tensors' ragged axes",
        )
    axes = tuple(sorted(d - depth for d in dims if d >= depth))
    if not axes or not all(isinstance(a, int) and 0 <= a < rank for a in axes):
        raise fail(
            fn,
            f"ragged_dims {ragged_dims!r} must name at least one axis of the tensors "
            f"(logical axes {depth}..{depth + rank - 1})",
        )
    return axes


def from_nested_list(
    samples: Sequence[Any], ragged_dims: Any = None, rectangular_dims: Sequence[int] = ()
) -> Ragged:
    """``from_list`` of lists (of lists ...) of tensors: nested ragged axes.

    Every sample is a list whose entries are tensors (or lists of them, one level
    deeper); a ``Ragged``, as a sample or at any level inside one, counts as the list
    of its samples, and a list of only ``Ragged`` samples stacks them as they are.
    ``ragged_dims`` names the list levels and then the tensors' ragged axes (default:
    their leading axis); ``rectangular_dims`` marks list levels rectangular with the
    level before.
    """
    fn = "from_list"
    if all(isinstance(s, Ragged) for s in samples):
        if ragged_dims is not None or rectangular_dims:
            raise fail(
                fn,
                "Ragged samples keep their own ragged axes: leave ragged_dims and "
                "rectangular_dims at their defaults",
            )
        return stack_samples(fn, samples)
    template = _first_ragged(samples)
    # (a Ragged gives the depth of its tensors even when it has no samples)
    depth = _leaf_depth(fn, samples, 0)
    samples = [_as_lists(s) for s in samples]
    if depth is None:
        raise fail(
            fn,
            "tensors holds only empty lists, so the dtype and dense shape are unknown; use "
            "from_nested_lengths(values, lengths) for a value without elements",
        )
    current: list[Any] = list(samples)
    lengths: list[list[int]] = []
    for level in range(1, depth):
        counts: list[int] = []
        children: list[Any] = []
        for n, item in enumerate(current):
            if not isinstance(item, (list, tuple)):
                where = f"sample {n}" if level == 1 else f"entry {n} at nesting depth {level}"
                raise fail(
                    fn,
                    f"{where} must be a list (of tensors or lists), got {describe(item)}; every "
                    f"tensor must sit at nesting depth {depth}",
                )
            counts.append(len(item))
            children.extend(item)
        lengths.append(counts)
        current = children
    if not current and template is not None:  # no tensor at all: dtype and shape from it
        empty = template.values.new_zeros((0, *template.values.shape[1:]))
        lengths.append([])
        levels = [torch.tensor(c, dtype=torch.int64, device=empty.device) for c in lengths]
        return build_nested(empty, levels)
    tensors: list[Tensor] = []
    for n, item in enumerate(current):
        if not isinstance(item, Tensor):
            where = f"sample {n}" if depth == 1 else f"entry {n} at nesting depth {depth}"
            raise fail(
                fn,
                f"{where} must be a tensor, got {describe(item)} (every tensor must sit at "
                f"nesting depth {depth}: samples mix tensors and lists)",
            )
        tensors.append(item)
    first = tensors[0]
    if first.ndim < 1:
        raise fail(fn, f"the tensors of a nested list need a leading axis, got {describe(first)}")
    ragged = _tensor_axes(fn, ragged_dims, depth, first.ndim)
    dense = tuple(a for a in range(first.ndim) if a not in ragged)
    for n, t in enumerate(tensors):
        if t.ndim != first.ndim or any(t.shape[a] != first.shape[a] for a in dense):
            raise fail(
                fn,
                f"tensor {n} of the innermost level has shape {shape_text(t.shape)}, expected "
                f"the sizes of tensor 0 ({shape_text(first.shape)}) along its axes "
                f"{[a + depth for a in dense]}, which are not ragged",
            )
        _same_dtype_and_device(fn, "tensor", n, t, first)
    order = (*ragged, *dense)  # storage: the tensors' ragged axes first, row-major
    sides = [[t.shape[a] for a in ragged] for t in tensors]
    for n, rect in enumerate(sides):
        _check_sides(fn, f"tensor {n} of the innermost level", rect)
    for k in range(len(ragged)):
        count = [math.prod(rect[:k]) for rect in sides]
        lengths.append([side[k] for side, c in zip(sides, count, strict=True) for _ in range(c)])
    dense_shape = tuple(first.shape[a] for a in dense)
    packed = [t.permute(order).reshape(-1, *dense_shape) for t in tensors]
    values = torch.cat(packed) if len(packed) > 1 else packed[0].clone()
    device = first.device
    levels = [torch.tensor(c, dtype=torch.int64, device=device) for c in lengths]
    num_levels = len(levels)
    rectangular = (*rectangular_dims, *range(depth + 1, depth + len(ragged)))
    layout = mixed_layout(fn, num_levels, len(dense), rectangular)
    # logical order: the list levels, then the tensors' axes where they were
    positions = (*range(depth - 1), *(depth - 1 + a for a in ragged))
    letters = tuple(a.nested for a in layout.axes if a.ragged)
    layout = Layout.from_ragged_positions(depth - 1 + first.ndim, positions, letters)
    if rectangular_dims:
        check_rectangles(fn, layout, build_nested(values, levels))
    return build_nested(values, levels, layout)
