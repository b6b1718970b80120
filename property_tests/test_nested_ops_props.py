"""Nested ragged values: cat along every axis, per-element products, gather and
masked_select equal the per-sample, per-row loop (values and gradients).

References read the operands' canonical form by hand (``nested_reference``);
operands come from ``nested_strategies`` (B = 0, B = 1, empty samples and empty
rows by construction).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests.nested_reference import Sample, assert_canonical, canonical, weighted_sum
from property_tests.nested_strategies import (
    ANY_FEATURES,
    ANY_LEVELS,
    build,
    level_lengths,
    nested_raggeds,
    relengthed,
)
from property_tests.strategies import _random_values

SETTINGS = settings(deadline=None, max_examples=25)


def _grads(result: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    total = weighted_sum(result)
    if not total.requires_grad:
        return [torch.zeros_like(t) for t in inputs]
    found = torch.autograd.grad(total, inputs, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, found, strict=True)]


def _value(
    lengths: list[list[int]], features: tuple[int, ...], rectangular: tuple[int, ...], seed: int
) -> raggedfn.Ragged:
    values = _random_values((sum(lengths[-1]), *features), torch.float64, seed)
    return build(lengths, values.requires_grad_(True), rectangular)


# ----- cat ---------------------------------------------------------------------------------


def _cat_reference(parts: list[list[Sample]], level: int) -> list[Sample]:
    """Per sample: the operands' elements of ``level`` within every element above it, one
    operand after the other, each renumbered after the ones before, with its subtree."""
    out: list[Sample] = []
    for samples in zip(*parts, strict=True):
        levels = len(samples[0][0])
        shift: dict[tuple[int, ...], int] = {}
        keyed: list[list[tuple[tuple[int, ...], Any]]] = [[] for _ in range(levels)]
        for keys, rows in samples:
            here: dict[tuple[int, ...], int] = {}
            for key in keys[level]:
                here[key[:level]] = here.get(key[:level], 0) + 1
            for k in range(level, levels):
                for n, key in enumerate(keys[k]):
                    moved = (
                        *key[:level],
                        key[level] + shift.get(key[:level], 0),
                        *key[level + 1 :],
                    )
                    keyed[k].append((moved, rows[n] if k == levels - 1 else None))
            for parent, count in here.items():
                shift[parent] = shift.get(parent, 0) + count
        new_keys = list(samples[0][0][:level])
        for k in range(level, levels):
            new_keys.append(sorted(key for key, _ in keyed[k]))
        rows = [row for _, row in sorted(keyed[-1], key=lambda item: item[0])]
        out.append((new_keys, rows))
    return out


def _rectangles_break(expected: list[Sample], level: int) -> bool:
    """Whether the elements of ``level`` under one element above them hold different
    numbers of elements of ``level + 1`` (a rectangle there would break)."""
    for keys, _ in expected:
        counts: dict[tuple[int, ...], int] = {key: 0 for key in keys[level]}
        for key in keys[level + 1]:
            counts[key[: level + 1]] += 1
        sides: dict[tuple[int, ...], set[int]] = {}
        for key, count in counts.items():
            sides.setdefault(key[:level], set()).add(count)
        if any(len(found) > 1 for found in sides.values()):
            return True
    return False


@SETTINGS
@given(ANY_LEVELS, ANY_FEATURES, st.integers(2, 3), st.data())
def test_cat_along_every_axis_of_nested_values(
    shape: tuple[int, tuple[int, ...]], features: tuple[int, ...], count: int, data: Any
) -> None:
    levels, rectangular = shape
    lengths = data.draw(level_lengths(levels, rectangular=rectangular))
    dim = data.draw(st.integers(1, levels + len(features)))
    seeds = data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=count, max_size=count))
    if dim > levels:  # a dense axis: one partition, new values
        xs = [_value(lengths, features, rectangular, seed) for seed in seeds]
        got = raggedfn.cat(xs, dim)
        j = dim - 1 - levels
        expected = []
        for samples in zip(*(canonical(x) for x in xs), strict=True):
            rows = [torch.cat(parts, j) for parts in zip(*(s[1] for s in samples), strict=True)]
            expected.append((samples[0][0], rows))
    else:
        level = dim - 1
        all_lengths = [lengths] + [
            data.draw(relengthed(lengths, level, rectangular=rectangular)) for _ in seeds[1:]
        ]
        xs = [
            _value(ls, features, rectangular, seed)
            for ls, seed in zip(all_lengths, seeds, strict=True)
        ]
        expected = _cat_reference([canonical(x) for x in xs], level)
        if level + 1 in rectangular and _rectangles_break(expected, level):
            with pytest.raises(raggedfn.RaggedError, match="rectangular"):
                raggedfn.cat(xs, dim)
            return
        got = raggedfn.cat(xs, dim)
    assert_canonical(got, expected)
    inputs = [x.values for x in xs]
    for g, e in zip(_grads(got, inputs), _grads(expected, inputs), strict=True):
        torch.testing.assert_close(g, e)


def test_cat_of_nested_values_refuses_other_outer_levels() -> None:
    x = raggedfn.from_nested_lengths(torch.randn(6, 3), [[2, 1], [1, 3, 2]])
    y = raggedfn.from_nested_lengths(torch.randn(6, 3), [[1, 2], [1, 3, 2]])
    assert raggedfn.cat([x, y], 1).sizes.tolist() == [[3, 5], [3, 7]]
    with pytest.raises(raggedfn.RaggedError, match="above axis 2"):
        raggedfn.cat([x, y], 2)
    with pytest.raises(raggedfn.RaggedError, match="another partition"):
        raggedfn.cat([x, y], 3)


# ----- products per element of the outer levels --------------------------------------------


def _per_element(x: raggedfn.Ragged, op: Any, out_ragged: int) -> list[Any]:
    """Per sample: ``op`` on the stacked rows ``[L, D]`` of every element of the level above
    the innermost; its result's first ``out_ragged`` axes become levels under that element
    (``out_ragged = 0``: one row per element)."""
    out: list[Any] = []
    levels = x.num_ragged
    for keys, rows in canonical(x):
        new_keys = [list(level) for level in keys[: levels - 1]]
        new_keys += [[] for _ in range(out_ragged)]
        new_rows: list[torch.Tensor] = []
        for parent in keys[levels - 2] if levels > 1 else [()]:
            members = [rows[n] for n, key in enumerate(keys[-1]) if key[:-1] == parent]
            line = torch.stack(members) if members else x.values.new_zeros(0, *x.values.shape[1:])
            result = op(line)
            if out_ragged == 0:
                new_rows.append(result)
                continue
            for k in range(out_ragged):
                for index in _indices(result.shape[: k + 1]):
                    new_keys[levels - 1 + k].append((*parent, *index))
            for index in _indices(result.shape[:out_ragged]):
                new_rows.append(result[index])
        out.append((new_keys, new_rows))
    return out


def _indices(shape: Any) -> list[tuple[int, ...]]:
    found: list[tuple[int, ...]] = [()]
    for n in shape:
        found = [(*i, c) for i in found for c in range(n)]
    return found


PRODUCTS = {
    # name: (raggedfn call on x with outer letters O, reference on one element's [L, D],
    #        ragged output axes below the element)
    "pairs": (lambda x, o: raggedfn.einsum(f"b{o}td,b{o}ud->b{o}tu", x, x), lambda t: t @ t.T, 2),
    "matmul": (
        lambda x, o: raggedfn.matmul(x, raggedfn.transpose(x, -1, -2)),
        lambda t: t @ t.T,
        2,
    ),
    "pairs_then_rows": (
        lambda x, o: raggedfn.einsum(
            f"b{o}tu,b{o}ud->b{o}td", raggedfn.einsum(f"b{o}td,b{o}ud->b{o}tu", x, x), x
        ),
        lambda t: (t @ t.T) @ t,
        1,
    ),
    "rows": (
        lambda x, o: raggedfn.einsum(f"b{o}td,b{o}td->b{o}t", x, x),
        lambda t: (t * t).sum(-1),
        1,
    ),
    "element": (
        lambda x, o: raggedfn.einsum(f"b{o}td,b{o}ud->b{o}", x, x),
        lambda t: (t @ t.T).sum(),
        0,
    ),
}


@SETTINGS
@given(nested_raggeds(requires_grad=True, feature_shape=(3,)), st.sampled_from(sorted(PRODUCTS)))
def test_products_per_element_of_the_outer_levels(x: raggedfn.Ragged, name: str) -> None:
    call, ref, out_ragged = PRODUCTS[name]
    outer = "ACE"[: x.num_ragged - 1]
    got = call(x, outer)
    expected = _per_element(x, ref, out_ragged)
    assert_canonical(got, expected)
    (g,) = _grads(got, [x.values])
    (e,) = _grads(expected, [x.values])
    torch.testing.assert_close(g, e)


# ----- gather and take_along_dim -------------------------------------------------------------


@settings(deadline=None, max_examples=60)
@given(
    ANY_LEVELS,
    st.sampled_from([(), (2,)]),
    st.sampled_from(["gather", "take_along_dim"]),
    st.data(),
)
def test_gather_along_every_axis_of_nested_values(
    shape: tuple[int, tuple[int, ...]], features: tuple[int, ...], name: str, data: Any
) -> None:
    levels, rectangular = shape
    lengths = data.draw(level_lengths(levels, rectangular=rectangular))
    x = _value(lengths, features, rectangular, data.draw(st.integers(0, 2**31 - 1)))
    if features and data.draw(st.booleans()):
        dim = 1 + levels + data.draw(st.integers(0, len(features) - 1))
    else:
        dim = data.draw(st.integers(1, levels))
    level = dim - 1
    if level < levels and data.draw(st.booleans()):
        index_lengths = data.draw(relengthed(lengths, level, rectangular=rectangular))
    else:
        index_lengths = lengths
    bad = data.draw(st.booleans()) and data.draw(st.booleans())  # an index naming nothing
    samples = canonical(x)
    present = [dict(zip(keys[-1], rows, strict=True)) for keys, rows in samples]
    index_keys = canonical(build(index_lengths, torch.zeros(sum(index_lengths[-1]), *features)))
    picks = data.draw(st.lists(st.integers(0, 2**16), min_size=1, max_size=1))[0]
    values: list[torch.Tensor] = []
    expected: list[Any] = []
    valid = True
    for (keys, _), rows_of in zip(index_keys, present, strict=True):
        out_rows = []
        for key in keys[-1]:
            if level >= levels:  # a dense axis: the same element, positions along it
                size = features[level - levels]
                idx = torch.randint(
                    0, size, features, generator=torch.Generator().manual_seed(picks)
                )
                picks += 1
                values.append(idx)
                out_rows.append(torch.gather(rows_of[key], level - levels, idx))
                continue
            idx = torch.zeros(features, dtype=torch.int64)
            row = torch.zeros(features, dtype=torch.float64)
            for pos in _indices(features):
                found = [v for v in range(4) if (*key[:level], v, *key[level + 1 :]) in rows_of]
                if bad or not found:  # the first value that names no element of x there
                    valid = False
                    idx[pos] = next(
                        v for v in range(5) if (*key[:level], v, *key[level + 1 :]) not in rows_of
                    )
                    continue
                v = found[picks % len(found)]
                picks = picks * 7 + 3
                idx[pos] = v
                row[pos] = rows_of[(*key[:level], v, *key[level + 1 :])][pos]
            values.append(idx)
            out_rows.append(row)
        expected.append((keys, out_rows))
    index = build(
        index_lengths,
        torch.stack(values) if values else torch.zeros(0, *features, dtype=torch.int64),
        rectangular,
    )
    op = raggedfn.gather if name == "gather" else raggedfn.take_along_dim
    args = (x, dim, index) if name == "gather" else (x, index, dim)
    if not valid:
        with pytest.raises(raggedfn.RaggedError, match="must name an element"):
            op(*args)
        return
    got = op(*args)
    assert_canonical(got, expected)
    (g,) = _grads(got, [x.values])
    (e,) = _grads(expected, [x.values])
    torch.testing.assert_close(g, e)


# ----- masked_select ---------------------------------------------------------------------------


@SETTINGS
@given(
    nested_raggeds(requires_grad=True, feature_shape=st.sampled_from([(), (2,), (2, 3)])),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_masked_select_reads_every_sample_in_packed_order(
    x: raggedfn.Ragged, rows_only: bool, seed: int
) -> None:
    shape = tuple(x.values.shape[1:])
    bits_shape = (x.values.shape[0],) if rows_only else x.values.shape
    bits = torch.rand(bits_shape, generator=torch.Generator().manual_seed(seed)) < 0.5
    mask = x.with_values(bits)
    got = raggedfn.masked_select(x, mask)
    expected = []
    for (_keys, rows), (_, chosen) in zip(canonical(x), canonical(mask), strict=True):
        picked = [r[m] for r, m in zip(rows, chosen, strict=True)]
        if rows_only and shape:
            kept = [r for r, m in zip(rows, chosen, strict=True) if bool(m)]
            expected.append(([[(n,) for n in range(len(kept))]], kept))
            continue
        flat = [v for p in picked for v in p.reshape(-1)]
        expected.append(([[(n,) for n in range(len(flat))]], flat))
    assert_canonical(got, expected)
    (g,) = _grads(got, [x.values])
    (e,) = _grads(expected, [x.values])
    torch.testing.assert_close(g, e)


def test_masked_select_needs_every_partition_of_x() -> None:
    x = raggedfn.from_nested_lengths(torch.randn(4), [[2], [1, 3]])
    mask = raggedfn.from_nested_lengths(torch.ones(4, dtype=torch.bool), [[2], [3, 1]])
    with pytest.raises(raggedfn.RaggedError, match="row_offsets"):
        raggedfn.masked_select(x, mask)
