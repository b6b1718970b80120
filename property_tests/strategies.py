"""Hypothesis strategies for ``Ragged`` values; reuse them in every property test.

``raggeds()`` reaches B = 0, B = 1, empty samples and all-equal sizes by
construction (each is an explicit branch of the draw, not luck).
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
    values = _random_values((total, *feature_shape), dtype, seed)
    if requires_grad and dtype.is_floating_point:
        values.requires_grad_(True)
    sizes = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), num_ragged)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    if rows:
        offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return Ragged(values, offsets, sizes, layout)
