"""Hypothesis strategies for ``Ragged`` values; reuse them in every property test.

``raggeds()`` reaches B = 0, B = 1, empty samples and all-equal sizes by
construction (each is an explicit branch of the draw, not luck). With
``values=EXTREMES`` it also reaches numerical extremes by construction: large
magnitudes (+-1e3), values near +-1e3 that overflow ``exp`` unless shifted,
``-inf`` entries, all-equal values, ties and subnormal numbers (see
:func:`extreme_values`).
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

from raggedfn import Layout, Ragged
from raggedfn._layout import Axis


@st.composite
def layouts(draw: Any, num_ragged: int, num_dense: int, dim_order: str = "any") -> Layout:
    """A layout with ``num_ragged`` ragged and ``num_dense`` dense axes.

    ``dim_order``: ``"standard"`` (ragged axes first, all in storage order),
    ``"ragged_first"`` (ragged first, any order within each kind) or ``"any"``.
    """
    ragged = [Axis(True, k) for k in range(num_ragged)]
    dense = [Axis(False, j) for j in range(num_dense)]
    if dim_order == "standard":
        return Layout(tuple(ragged + dense))
    ragged = draw(st.permutations(ragged)) if num_ragged > 1 else ragged
    dense = draw(st.permutations(dense)) if num_dense > 1 else dense
    if dim_order == "ragged_first":
        return Layout(tuple(ragged + dense))
    axes = draw(st.permutations(ragged + dense))
    return Layout(tuple(axes))


@st.composite
def batch_sizes(
    draw: Any,
    num_ragged: int,
    max_batch: int = 5,
    max_size: int = 5,
    square: bool = False,
    min_batch: int = 0,
) -> list[list[int]]:
    """Per-sample ragged sizes; explicit branches for B = 0/1, empty and equal sizes."""
    kind = draw(
        st.sampled_from(["random", "random", "empty_batch", "single", "equal", "with_empty"])
    )
    if kind == "empty_batch" and min_batch == 0:
        return []
    batch = 1 if kind == "single" else draw(st.integers(max(min_batch, 1), max(max_batch, 1)))
    row = st.lists(st.integers(0, max_size), min_size=num_ragged, max_size=num_ragged)
    if kind == "equal":
        one = draw(row)
        rows = [list(one) for _ in range(batch)]
    else:
        rows = [draw(row) for _ in range(batch)]
        if kind == "with_empty":
            rows[draw(st.integers(0, batch - 1))] = [0] * num_ragged
    if square:
        rows = [[r[0]] * num_ragged for r in rows]
    return rows


def _random_values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-5, 6, shape, generator=gen, dtype=dtype)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


# Kinds of values: "normal" draws randn; the rest are the extremes (see extreme_values).
VALUE_KINDS = ("normal", "large", "shifted", "neg_inf", "all_equal", "ties", "subnormal")
EXTREMES = st.sampled_from(VALUE_KINDS[1:])
# +inf and NaN entries: only the ops whose torch answer is defined there draw these
NON_FINITE_KINDS = ("pos_inf", "nan")
NON_FINITE = st.sampled_from((*NON_FINITE_KINDS, "neg_inf", "large"))


def extreme_values(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int, kind: str
) -> torch.Tensor:
    """Floating values of one kind, each an edge a kernel can get wrong.

    Args:
        shape: the result's shape.
        dtype: a floating dtype.
        seed: seeds the generator.
        kind: ``"normal"`` (randn); ``"large"`` (randn * 1e3: +-1e3 magnitudes);
            ``"shifted"`` (+-1e3 + randn, one sign: ``exp`` overflows or underflows to
            0 unless the maximum is subtracted first); ``"neg_inf"`` (randn with about
            a third of the entries -inf, often whole rows); ``"all_equal"`` (one value
            everywhere, 0 or +-1e3 or 1.5); ``"ties"`` (+-1e3 * a few half-integers:
            many exact ties); ``"subnormal"`` (small multiples of the dtype's
            smallest normal number / 8: subnormal or zero); ``"pos_inf"`` (+-1e3 * randn
            with about a fifth of the entries +inf and a fifth -inf); ``"nan"`` (+-1e3 *
            randn with about a sixth of the entries NaN).

    Returns:
        ``shape`` tensor of ``dtype``.
    """
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(shape, generator=gen, dtype=torch.float64)
    if kind == "normal":
        out = normal
    elif kind == "large":
        out = normal * 1e3
    elif kind == "shifted":
        sign = 1.0 if torch.rand((), generator=gen) < 0.5 else -1.0
        out = sign * 1e3 + normal
    elif kind == "neg_inf":
        # whole packed rows -inf too: then a sample or a line can be -inf throughout
        rows = torch.rand(shape[:1], generator=gen) < 0.3
        hit = (torch.rand(shape, generator=gen) < 0.3) | rows.reshape(-1, *([1] * (len(shape) - 1)))
        out = torch.where(hit, float("-inf"), normal)
    elif kind == "all_equal":
        choice = int(torch.randint(0, 4, (), generator=gen))
        out = torch.full(shape, (0.0, 1e3, -1e3, 1.5)[choice], dtype=torch.float64)
    elif kind == "ties":
        out = torch.round(normal * 1.5) / 2 * 1e3
    elif kind == "subnormal":
        # k * 2**-129 (float32) or k * 2**-1025 (float64): exact in float64, subnormal in dtype
        steps = torch.randint(-4, 5, shape, generator=gen, dtype=torch.float64)
        out = steps * (torch.finfo(dtype).tiny / 8)
    elif kind == "pos_inf":
        pick = torch.rand(shape, generator=gen)
        out = torch.where(pick < 0.2, float("inf"), normal * 1e3)
        out = torch.where(pick > 0.8, float("-inf"), out)
    elif kind == "nan":
        hit = torch.rand(shape, generator=gen) < 0.17
        out = torch.where(hit, float("nan"), normal * 1e3)
    else:
        kinds = (*VALUE_KINDS, *NON_FINITE_KINDS)
        raise ValueError(f"unknown kind of values {kind!r}; expected one of {kinds}")
    return out.to(dtype)


ANY_RAGGED = st.sampled_from([1, 2])
ANY_FEATURES = st.sampled_from([(), (3,), (2, 3)])


@st.composite
def raggeds(
    draw: Any,
    num_ragged: int | Any = ANY_RAGGED,
    feature_shape: tuple[int, ...] | Any = ANY_FEATURES,
    dtype: torch.dtype | Any = torch.float64,
    dim_order: str = "any",
    requires_grad: bool = False,
    max_batch: int = 5,
    max_size: int = 5,
    min_batch: int = 0,
    square: bool = False,
    values: str | Any = "normal",
) -> Ragged:
    """A ``Ragged`` value drawn with the given options.

    Args:
        num_ragged: R (int) or a strategy for it.
        feature_shape: dense sample axes (tuple) or a strategy for them.
        dtype: values dtype or a strategy for it.
        dim_order: ``"standard"``, ``"ragged_first"`` or ``"any"`` (see ``layouts``).
        requires_grad: make ``values`` a leaf that requires grad (float dtypes).
        max_batch, max_size: bounds on B and on each ragged size.
        min_batch: smallest B (use 1 where an op needs a sample).
        square: all ragged sizes of a sample equal (pair states ``N_i x N_i``).
        values: a kind of floating values (``VALUE_KINDS``) or a strategy for one,
            e.g. ``EXTREMES``; integer and bool dtypes ignore it.
    """
    if not isinstance(num_ragged, int):
        num_ragged = draw(num_ragged)
    if not isinstance(feature_shape, tuple):
        feature_shape = draw(feature_shape)
    if not isinstance(dtype, torch.dtype):
        dtype = draw(dtype)
    layout = draw(layouts(num_ragged, len(feature_shape), dim_order))
    rows = draw(batch_sizes(num_ragged, max_batch, max_size, square, min_batch))
    lengths = [int(torch.tensor(r).prod()) if r else 1 for r in rows]
    total = sum(lengths)
    seed = draw(st.integers(0, 2**31 - 1))
    kind = values if isinstance(values, str) else draw(values)
    if kind != "normal" and dtype.is_floating_point:
        packed = extreme_values((total, *feature_shape), dtype, seed, kind)
    else:
        packed = _random_values((total, *feature_shape), dtype, seed)
    if requires_grad and dtype.is_floating_point:
        packed.requires_grad_(True)
    sizes = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), num_ragged)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    if rows:
        offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return Ragged(packed, offsets, sizes, layout)
