"""Nested ragged values: every op on every level equals the per-sample, per-row loop.

References are in ``nested_reference`` (canonical form read by hand from the
raw partitions); values come from ``nested_strategies`` (B = 0, B = 1, empty
samples, empty rows and equal sizes by construction). Gradients are compared
through a scalar that weighs every output element differently.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests.nested_reference import (
    aligned,
    assert_canonical,
    canonical,
    dense_shape,
    lines,
    reduce,
    stack,
    weighted_sum,
)
from property_tests.nested_strategies import build, level_lengths, nested_raggeds

SETTINGS = settings(deadline=None, max_examples=25)


def _grad(result: Any, x: raggedfn.Ragged) -> torch.Tensor:
    total = weighted_sum(result)
    if not total.requires_grad:  # nothing to differentiate (no output elements)
        return torch.zeros_like(x.values)
    (g,) = torch.autograd.grad(total, x.values, allow_unused=True)
    return torch.zeros_like(x.values) if g is None else g


def _grads_match(got: Any, expected: Any, x: raggedfn.Ragged) -> None:
    torch.testing.assert_close(_grad(got, x), _grad(expected, x), equal_nan=True)


def _level_subsets(levels: int) -> list[tuple[int, ...]]:
    return [
        combo
        for size in range(1, levels + 1)
        for combo in itertools.combinations(range(levels), size)
    ]


# ----- construction and conversion -----------------------------------------------------


@SETTINGS
@given(st.data())
def test_constructors_agree_with_hand_built_partitions(data: Any) -> None:
    levels = data.draw(st.sampled_from([1, 2, 3]))
    lengths = data.draw(level_lengths(levels))
    values = torch.randn(sum(lengths[-1]), 2, dtype=torch.float64)
    x = raggedfn.from_nested_lengths(values, lengths)
    assert x.values is values
    if levels == 1:
        assert x.layout.code == "r0 d0" and x.lengths.tolist() == lengths[0]
        return
    want = build(lengths, values)
    assert x.layout == want.layout and x.shape == (len(lengths[0]), *[None] * levels, 2)
    for a, b in zip(
        (x.offsets, x.sizes, *x.row_offsets),
        (want.offsets, want.sizes, *want.row_offsets),
        strict=True,
    ):
        assert torch.equal(a, b)
    assert raggedfn.check(x) is x


def _node(x: raggedfn.Ragged, sample: Any, prefix: tuple[int, ...], depth: int) -> Any:
    """The element ``prefix`` of a canonical sample as nested lists of tensors."""
    keys, rows = sample
    if depth == len(keys) - 1:
        here = [rows[n] for n, k in enumerate(keys[-1]) if k[:-1] == prefix]
        return stack(here, dense_shape(x), x.values)
    return [_node(x, sample, k, depth + 1) for k in keys[depth] if k[:-1] == prefix]


def _as_lists(x: raggedfn.Ragged) -> list[Any]:
    """Samples as nested Python lists of ``[L, *dense]`` tensors, from the canonical form."""
    return [_node(x, sample, (), 0) for sample in canonical(x)]


@SETTINGS
@given(nested_raggeds(min_batch=1), st.data())
def test_from_list_samples_and_unbind_round_trip(x: raggedfn.Ragged, data: Any) -> None:
    nested_lists = _as_lists(x)
    if any(isinstance(t, torch.Tensor) for s in nested_lists for t in _leaves(s)):
        y = raggedfn.from_list(nested_lists)
        assert_canonical(y, canonical(x))
    z = raggedfn.from_list(list(raggedfn.unbind(x))) if _has_rows(x) else x
    assert_canonical(z, canonical(x))
    i = data.draw(st.integers(0, x.batch_size - 1))
    keys, rows = canonical(x)[i]
    sample = x[i]
    assert sample.batch_size == len(keys[0])
    # sample i's element s is the sub-tree of x's level-0 element (s,)
    expected = []
    for s in range(len(keys[0])):
        sub_keys = [[k[1:] for k in level if k[0] == s] for level in keys[1:]]
        sub_rows = [r for r, k in zip(rows, keys[-1], strict=True) if k[0] == s]
        expected.append((sub_keys, sub_rows))
    assert_canonical(sample, expected)


def _leaves(item: Any) -> list[Any]:
    if isinstance(item, list):
        return [leaf for child in item for leaf in _leaves(child)]
    return [item]


def _has_rows(x: raggedfn.Ragged) -> bool:
    return any(len(keys[0]) for keys, _ in canonical(x))


@SETTINGS
@given(nested_raggeds(), st.data())
def test_sub_batches_and_cat(x: raggedfn.Ragged, data: Any) -> None:
    picks = data.draw(st.lists(st.integers(0, max(x.batch_size - 1, 0)), max_size=4))
    if x.batch_size == 0:
        picks = []
    y = x[picks]
    raggedfn.check(y)
    whole = canonical(x)
    assert_canonical(y, [whole[i] for i in picks])
    joined = raggedfn.cat([x, y], 0)
    raggedfn.check(joined)
    assert_canonical(joined, whole + [whole[i] for i in picks])


@SETTINGS
@given(nested_raggeds(feature_shape=st.sampled_from([(), (2,)])))
def test_to_padded_and_mask_pad_every_level(x: raggedfn.Ragged) -> None:
    padded = raggedfn.to_padded(x, fill=-7.0)
    mask = raggedfn.mask(x)
    levels = x.num_ragged
    assert padded.shape[: 1 + levels] == mask.shape
    expected = torch.full(padded.shape, -7.0, dtype=x.dtype)
    expected_mask = torch.zeros(mask.shape, dtype=torch.bool)
    for i, (keys, rows) in enumerate(canonical(x)):
        for key, row in zip(keys[-1], rows, strict=True):
            expected[(i, *key)] = row
            expected_mask[(i, *key)] = True
        for level in keys:  # every level's extent is its largest size
            for key in level:
                assert all(c < padded.shape[1 + n] for n, c in enumerate(key))
    assert torch.equal(padded, expected) and torch.equal(mask, expected_mask)
    widths = [0] * levels
    for keys, _ in canonical(x):
        for k, level in enumerate(keys):
            for key in level:
                widths[k] = max(widths[k], key[-1] + 1)
    assert list(mask.shape[1:]) == widths


# ----- reductions ----------------------------------------------------------------------

REDUCTIONS: dict[
    str, tuple[Callable[..., Any], Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]]
] = {
    "sum": (raggedfn.sum, lambda t, d: t.sum(d)),
    "mean": (raggedfn.mean, lambda t, d: t.mean(d)),
    "amax": (
        raggedfn.amax,
        lambda t, d: (
            t.amax(d) if t.shape[0] else torch.full(t.sum(d).shape, -math.inf, dtype=t.dtype)
        ),
    ),
    "amin": (
        raggedfn.amin,
        lambda t, d: (
            t.amin(d) if t.shape[0] else torch.full(t.sum(d).shape, math.inf, dtype=t.dtype)
        ),
    ),
    "logsumexp": (raggedfn.logsumexp, lambda t, d: torch.logsumexp(t, d)),
    "prod": (
        raggedfn.prod,
        lambda t, d: (
            t.prod(d[0])
            if len(d) == 1
            else t.flatten(0, -1).prod(0)
            if t.ndim == len(d)
            else _prod_dims(t, d)
        ),
    ),
    "norm": (lambda x, d: raggedfn.norm(x, 2, d), lambda t, d: torch.linalg.vector_norm(t, 2, d)),
}


def _prod_dims(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    for d in sorted(dims, reverse=True):
        t = t.prod(d)
    return t


@SETTINGS
@given(
    nested_raggeds(requires_grad=True, feature_shape=st.sampled_from([(2,), (2, 3)])),
    st.sampled_from(sorted(REDUCTIONS)),
    st.data(),
)
def test_reductions_on_every_level(x: raggedfn.Ragged, name: str, data: Any) -> None:
    op, ref = REDUCTIONS[name]
    levels = data.draw(st.sampled_from(_level_subsets(x.num_ragged)))
    dense = data.draw(st.sampled_from([(), (0,)]))
    dims = tuple(1 + k for k in levels) + tuple(1 + x.num_ragged + j for j in dense)
    got = op(x, dims)
    expected = reduce(x, levels, lambda t: ref(t, (0, *[1 + j for j in dense])))
    assert_canonical(got, expected)
    if levels == (x.num_ragged - 1,):  # the innermost axis alone: a value one level less
        assert isinstance(got, raggedfn.Ragged) and got.num_ragged == x.num_ragged - 1
    if len(levels) == x.num_ragged:
        assert isinstance(got, torch.Tensor)
    _grads_match(got, expected, x)


@SETTINGS
@given(nested_raggeds(dtype=torch.bool, feature_shape=st.sampled_from([(), (2,)])), st.data())
def test_all_any_on_every_level(x: raggedfn.Ragged, data: Any) -> None:
    levels = data.draw(st.sampled_from(_level_subsets(x.num_ragged)))
    dims = tuple(1 + k for k in levels)
    assert_canonical(raggedfn.all(x, dims), reduce(x, levels, lambda t: t.all(0)))
    assert_canonical(raggedfn.any(x, dims), reduce(x, levels, lambda t: t.any(0)))


@SETTINGS
@given(nested_raggeds(feature_shape=st.sampled_from([(), (2,)])), st.data(), st.booleans())
def test_argmax_argmin_on_every_level(x: raggedfn.Ragged, data: Any, largest: bool) -> None:
    level = data.draw(st.integers(0, x.num_ragged - 1))
    got = (raggedfn.argmax if largest else raggedfn.argmin)(x, 1 + level)
    shape = dense_shape(x)
    expected: list[Any] = []
    for sample in canonical(x):
        out_keys, members = aligned(sample, (level,))
        keys, rows = sample
        values = []
        for m in members:
            if not m:
                values.append(torch.full(shape, -1, dtype=torch.int64))
                continue
            t = stack([rows[r] for r in m], shape, x.values)
            at = t.argmax(0) if largest else t.argmin(0)
            coords = torch.tensor([keys[-1][r][level] for r in m])
            values.append(coords[at])
        expected.append((out_keys, values) if out_keys else values[0])
    assert_canonical(got, expected)


@SETTINGS
@given(nested_raggeds(requires_grad=True), st.data())
def test_keepdim_keeps_a_size_one_axis(x: raggedfn.Ragged, data: Any) -> None:
    level = x.num_ragged - 1
    got = raggedfn.sum(x, 1 + level, keepdim=True)
    assert got.shape[1 + level] == 1
    flat = raggedfn.squeeze(got, 1 + level)
    assert_canonical(flat, reduce(x, (level,), lambda t: t.sum(0)))


# ----- along one level -------------------------------------------------------------------


@SETTINGS
@given(
    nested_raggeds(requires_grad=True),
    st.sampled_from(["softmax", "log_softmax", "cumsum"]),
    st.data(),
)
def test_softmax_and_cumsum_along_every_level(x: raggedfn.Ragged, name: str, data: Any) -> None:
    level = data.draw(st.integers(0, x.num_ragged - 1))
    ops = {
        "softmax": (raggedfn.softmax, lambda t: torch.softmax(t, 0)),
        "log_softmax": (raggedfn.log_softmax, lambda t: torch.log_softmax(t, 0)),
        "cumsum": (raggedfn.cumsum, lambda t: torch.cumsum(t, 0)),
    }
    op, ref = ops[name]
    got = op(x, 1 + level)
    expected = lines(x, level, ref)
    assert_canonical(got, expected)
    _grads_match(got, expected, x)


@SETTINGS
@given(nested_raggeds(requires_grad=True), st.booleans(), st.integers(0, 3))
def test_sort_and_topk_along_the_innermost_level(
    x: raggedfn.Ragged, descending: bool, k: int
) -> None:
    level = x.num_ragged - 1
    values, indices = raggedfn.sort(x, 1 + level, descending=descending)
    expected_values = lines(
        x, level, lambda t: torch.sort(t, dim=0, descending=descending, stable=True).values
    )
    expected_indices = lines(
        x.detach(),
        level,
        lambda t: torch.sort(t, dim=0, descending=descending, stable=True).indices,
    )
    assert_canonical(values, expected_values)
    assert_canonical(indices, expected_indices)
    _grads_match(values, expected_values, x)
    top, where = raggedfn.topk(x, k, dim=1 + level, largest=descending)
    raggedfn.check(top)
    for got, expected in ((top, expected_values), (where, expected_indices)):
        for (keys, rows), (want_keys, want_rows) in zip(canonical(got), expected, strict=True):
            keep = [n for n, key in enumerate(want_keys[-1]) if key[-1] < k]
            assert keys[:-1] == want_keys[:-1] and keys[-1] == [want_keys[-1][n] for n in keep]
            for got_row, n in zip(rows, keep, strict=True):
                torch.testing.assert_close(got_row, want_rows[n])


def _sorted_lines(x: raggedfn.Ragged, level: int, descending: bool) -> tuple[list[Any], list[Any]]:
    """Per sample: every aligned line along ``level`` sorted (stably), values and the
    coordinates along ``level`` they came from (as ``argmax`` reports them)."""
    shape = dense_shape(x)
    values_out: list[Any] = []
    indices_out: list[Any] = []
    for keys, rows in canonical(x):
        values: list[Any] = [None] * len(rows)
        indices: list[Any] = [None] * len(rows)
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, key in enumerate(keys[-1]):
            groups.setdefault(key[:level] + key[level + 1 :], []).append(r)
        for members in groups.values():
            line = stack([rows[r] for r in members], shape, x.values)
            ordered = torch.sort(line, dim=0, descending=descending, stable=True)
            coords = torch.tensor([keys[-1][r][level] for r in members])
            for n, r in enumerate(members):
                values[r] = ordered.values[n]
                indices[r] = coords[ordered.indices[n]]
        values_out.append((keys, values))
        indices_out.append((keys, indices))
    return values_out, indices_out


@SETTINGS
@given(nested_raggeds(requires_grad=True), st.booleans(), st.data())
def test_sort_along_every_level(x: raggedfn.Ragged, descending: bool, data: Any) -> None:
    level = data.draw(st.integers(0, x.num_ragged - 1))
    values, indices = raggedfn.sort(x, 1 + level, descending=descending)
    expected_values, expected_indices = _sorted_lines(x, level, descending)
    assert_canonical(values, expected_values)
    assert_canonical(indices, expected_indices)
    assert_canonical(raggedfn.argsort(x, 1 + level, descending=descending), expected_indices)
    _grads_match(values, expected_values, x)


def test_topk_along_an_outer_level_is_refused() -> None:
    # the k largest of every aligned line along an outer axis are not a prefix of
    # each row (they would leave holes), so topk refuses
    x = raggedfn.from_nested_lengths(torch.randn(3), [[2], [1, 2]])
    with pytest.raises(raggedfn.RaggedError, match="outer nested ragged axis"):
        raggedfn.topk(x, 1, dim=1)


def _narrowed(x: raggedfn.Ragged, level: int, start: int, length: int) -> list[Any]:
    """Per sample: within every element of the level above (the sample for level 0),
    the elements of ``level`` at positions ``b .. b + length`` (``b = start``, or the
    count plus ``start`` floored at 0), each with everything below it, renumbered."""
    out: list[Any] = []
    for keys, rows in canonical(x):
        counts: dict[tuple[int, ...], int] = {}
        for key in keys[level]:
            counts[key[:level]] = counts.get(key[:level], 0) + 1
        window = {
            parent: (b, min(b + length, n))
            for parent, n in counts.items()
            for b in [max(n + start, 0) if start < 0 else start]
        }
        new_keys: list[list[tuple[int, ...]]] = []
        for k, level_keys in enumerate(keys):
            if k < level:
                new_keys.append(level_keys)
                continue
            new_keys.append([])
            for key in level_keys:
                b, e = window[key[:level]]
                if b <= key[level] < e:
                    new_keys[-1].append((*key[:level], key[level] - b, *key[level + 1 :]))
        new_rows = []
        for key, row in zip(keys[-1], rows, strict=True):
            b, e = window[key[:level]]
            if b <= key[level] < e:
                new_rows.append(row)
        out.append((new_keys, new_rows))
    return out


@SETTINGS
@given(nested_raggeds(requires_grad=True), st.integers(-4, 3), st.integers(0, 3), st.data())
def test_narrow_along_every_level(x: raggedfn.Ragged, start: int, length: int, data: Any) -> None:
    level = data.draw(st.integers(0, x.num_ragged - 1))
    got = raggedfn.narrow(x, 1 + level, start, length)
    raggedfn.check(got)
    expected = _narrowed(x, level, start, length)
    assert_canonical(got, expected)
    _grads_match(got, expected, x)


# ----- elementwise and broadcasting ---------------------------------------------------------


@SETTINGS
@given(nested_raggeds(requires_grad=True, feature_shape=st.sampled_from([(2,), (2, 3)])), st.data())
def test_elementwise_and_broadcasting_against_outer_levels(x: raggedfn.Ragged, data: Any) -> None:
    levels = x.num_ragged
    shape = dense_shape(x)
    other = x.with_values(torch.randn_like(x.values))  # the same partition, new values
    got = x * other + 1.0
    expected = []
    for (keys, rows), (_, others) in zip(canonical(x), canonical(other), strict=True):
        expected.append((keys, [a * b + 1.0 for a, b in zip(rows, others, strict=True)]))
    assert_canonical(got, expected)
    _grads_match(got, expected, x)
    # a value holding the outer levels (size 1 along the inner ones) broadcasts by ancestor
    keep = data.draw(st.integers(1, levels - 1))
    outer = raggedfn.sum(x, tuple(range(1 + keep, 1 + levels)), keepdim=True)
    got = x - outer
    expected = []
    for keys, rows in canonical(x):
        totals: dict[tuple[int, ...], torch.Tensor] = {}
        for key, row in zip(keys[-1], rows, strict=True):
            totals[key[:keep]] = totals.get(key[:keep], 0) + row
        expected.append(
            (keys, [row - totals[key[:keep]] for key, row in zip(keys[-1], rows, strict=True)])
        )
    assert_canonical(got, expected)
    _grads_match(got, expected, x)
    # dense operands: per feature and per sample
    per_sample = torch.randn(x.batch_size, *([1] * levels), *shape, dtype=x.dtype)
    got = x / 2 + per_sample
    expected = [
        (keys, [row / 2 + per_sample[i].reshape(shape) for row in rows])
        for i, (keys, rows) in enumerate(canonical(x))
    ]
    assert_canonical(got, expected)


def test_mismatched_nested_partitions_are_refused() -> None:
    a = raggedfn.from_nested_lengths(torch.randn(4), [[2], [1, 3]])
    b = raggedfn.from_nested_lengths(torch.randn(4), [[2], [3, 1]])
    rectangular = raggedfn.from_sizes(torch.randn(4), [[2, 2]])
    for bad in (lambda: a + b, lambda: a + rectangular, lambda: rectangular * a):
        try:
            bad()
        except raggedfn.RaggedError as error:
            assert "partition" in str(error) or "nested" in str(error)
        else:
            raise AssertionError("expected RaggedError")


@SETTINGS
@given(nested_raggeds(requires_grad=True, feature_shape=(3,)))
def test_linear_and_layer_norm_act_on_rows(x: raggedfn.Ragged) -> None:
    weight = torch.randn(2, 3, dtype=x.dtype)
    got = raggedfn.layer_norm(raggedfn.linear(x, weight), 2)
    expected = [
        (keys, [torch.nn.functional.layer_norm(weight @ row, (2,)) for row in rows])
        for keys, rows in canonical(x)
    ]
    assert_canonical(got, expected)
    _grads_match(got, expected, x)


# ----- shape: joining and splitting levels ------------------------------------------------------


@SETTINGS
@given(nested_raggeds(), st.data())
def test_flatten_joins_levels_and_unflatten_splits_them(x: raggedfn.Ragged, data: Any) -> None:
    levels = x.num_ragged
    first = data.draw(st.integers(0, levels - 2))
    flat = raggedfn.flatten(x, 1 + first, 2 + first)
    assert flat.values is x.values and flat.num_ragged == levels - 1
    raggedfn.check(flat)
    expected = []
    for keys, rows in canonical(x):
        # the joined level numbers the inner elements in order within each outer element
        def joined(key: tuple[int, ...], level: list[tuple[int, ...]]) -> tuple[int, ...]:
            head = key[:first]
            before = [k for k in level if k[:first] == head and k[: first + 2] < key[: first + 2]]
            inner = len({k[: first + 2] for k in before})
            return (*head, inner, *key[first + 2 :])

        new_keys = [level for k, level in enumerate(keys) if k < first]
        new_keys += [[joined(key, keys[first + 1]) for key in level] for level in keys[first + 1 :]]
        expected.append((new_keys, rows))
    assert_canonical(flat, expected)
    # the lengths of the joined level (children of each element of level `first`) give x back
    per_level: list[list[int]] = [[] for _ in range(first + 1)]
    counts: list[int] = []
    for keys, _ in canonical(x):
        per_level[0].append(len(keys[0]))
        for k in range(1, first + 1):
            per_level[k] += [sum(1 for c in keys[k] if c[:-1] == key) for key in keys[k - 1]]
        counts += [sum(1 for c in keys[first + 1] if c[:-1] == key) for key in keys[first]]
    lengths = raggedfn.from_nested_lengths(torch.tensor(counts, dtype=torch.int64), per_level)
    back = raggedfn.unflatten(flat, 1 + first, lengths)
    raggedfn.check(back)
    assert_canonical(back, canonical(x))
    # per-row lengths promise no rectangle: every ragged axis after the first is nested
    chain = " ".join(f"n{p[1:]}" if p[0] == "r" and p != "r0" else p for p in x.layout.code.split())
    assert back.layout.code == chain


def test_unflatten_refuses_lengths_that_do_not_add_up() -> None:
    tokens = raggedfn.from_lengths(torch.zeros(5, 2), [3, 2])
    bad = raggedfn.from_lengths(torch.tensor([1, 1, 2]), [2, 1])
    try:
        raggedfn.unflatten(tokens, 1, bad)
    except raggedfn.RaggedError as error:
        assert "add up" in str(error)
    else:
        raise AssertionError("expected RaggedError")


# ----- index vectors --------------------------------------------------------------------------


@SETTINGS
@given(nested_raggeds(), st.data())
def test_segment_ids_and_positions_on_every_level(x: raggedfn.Ragged, data: Any) -> None:
    level = data.draw(st.integers(0, x.num_ragged - 1))
    ids = raggedfn.segment_ids(x, 1 + level).tolist()
    positions = raggedfn.positions(x, 1 + level)
    expected_ids: list[int] = []
    offset = 0
    for i, (keys, _) in enumerate(canonical(x)):
        if level == 0:
            expected_ids += [i] * len(keys[-1])
            continue
        parents = keys[level - 1]
        index = {key: offset + n for n, key in enumerate(parents)}
        expected_ids += [index[key[:level]] for key in keys[-1]]
        offset += len(parents)
    assert ids == expected_ids
    assert [int(v) for _, rows in canonical(positions) for v in rows] == [
        key[level] for keys, _ in canonical(x) for key in keys[-1]
    ]
    assert raggedfn.segment_ids(x).tolist() == [
        i for i, (keys, _) in enumerate(canonical(x)) for _ in keys[-1]
    ]


@SETTINGS
@given(
    st.lists(st.integers(0, 4), max_size=12),
    st.integers(0, 2),
    st.sampled_from([(), (3,)]),
)
def test_from_segment_ids_and_group_by(
    ids_list: list[int], extra: int, features: tuple[int, ...]
) -> None:
    num = (max(ids_list) + 1 if ids_list else 0) + extra
    values = torch.randn(len(ids_list), *features, dtype=torch.float64)
    ids = torch.tensor(ids_list, dtype=torch.int64)
    grouped, order = raggedfn.group_by(values, ids, num)
    assert torch.equal(grouped.values, values[order])
    assert grouped.lengths.tolist() == [ids_list.count(g) for g in range(num)]
    stable = sorted(range(len(ids_list)), key=lambda t: (ids_list[t], t))
    assert order.tolist() == stable
    assert raggedfn.segment_ids(grouped).tolist() == sorted(ids_list)
    again = raggedfn.from_segment_ids(grouped.values, raggedfn.segment_ids(grouped), num)
    assert torch.equal(again.offsets, grouped.offsets) and again.values is grouped.values
    if sorted(ids_list) != ids_list:
        try:
            raggedfn.from_segment_ids(values, ids, num)
        except raggedfn.RaggedError as error:
            assert "sorted" in str(error)
        else:
            raise AssertionError("unsorted ids must raise")
