"""Property tests of the value, its constructors and conversions against per-sample references.

The references (``property_tests.reference``) cut samples out of the packed storage
by hand; the padded and mask references below are built here from those samples,
never from raggedfn's own conversions.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import optree
import torch
import torch.utils._cxx_pytree as cxx_pytree
import torch.utils._pytree as torch_pytree
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests.reference import assert_same, loop, pack_like, samples
from property_tests.strategies import raggeds
from raggedfn import Ragged
from raggedfn._index import segment_ids
from raggedfn._ragged import OPTREE_NAMESPACE

FLOATS = st.sampled_from([torch.float64, torch.float32])
ANY_DTYPE = st.sampled_from([torch.float64, torch.float32, torch.int64, torch.bool])
SETTINGS = settings(deadline=None, max_examples=50)


def ragged_positions(x: Ragged) -> list[int]:
    """Logical sample positions of the ragged axes, ascending."""
    return [p for p, a in enumerate(x.layout.axes) if a.ragged]


def sizes_by_position(x: Ragged) -> torch.Tensor:
    """``[B, R]`` sizes with columns in the logical order of the ragged axes."""
    return torch.stack([x.sizes[:, a.index] for a in x.layout.axes if a.ragged], dim=1)


def padded_by_hand(x: Ragged, fill) -> torch.Tensor:
    """Stack per-sample tensors into a ``[B, *max shape]`` tensor, by hand."""
    parts = samples(x)
    rank = x.layout.rank
    dense = list(x.values.shape[1:])
    extents = []
    for p, a in enumerate(x.layout.axes):
        if a.ragged:
            extents.append(max([t.shape[p] for t in parts], default=0))
        else:
            extents.append(dense[a.index])
    out = torch.full((len(parts), *extents), fill, dtype=x.dtype)
    for i, t in enumerate(parts):
        out[(i, *(slice(0, t.shape[p]) for p in range(rank)))] = t
    return out


# ----- round trips ------------------------------------------------------------------------


@SETTINGS
@given(raggeds(dtype=ANY_DTYPE, min_batch=1))
def test_from_list_of_unbind_is_the_same_value(x):
    y = raggedfn.from_list(list(raggedfn.unbind(x)), ragged_dims=x.ragged_dims)
    raggedfn.check(y)
    assert y.shape == x.shape and y.ragged_dims == x.ragged_dims
    assert_same(y, samples(x), rtol=0, atol=0)
    # from_list numbers ragged axes by position: where x does too, storage is identical
    if x.layout == y.layout:
        assert torch.equal(y.values, x.values) and torch.equal(y.sizes, x.sizes)
        assert torch.equal(y.offsets, x.offsets)


@SETTINGS
@given(raggeds(dtype=ANY_DTYPE), st.sampled_from([0, -1, 7]))
def test_from_padded_of_to_padded_is_the_same_value(x, fill):
    padded = raggedfn.to_padded(x, fill=fill)
    y = raggedfn.from_padded(padded, sizes_by_position(x), ragged_dims=x.ragged_dims)
    raggedfn.check(y)
    assert y.shape == x.shape
    assert_same(y, samples(x), rtol=0, atol=0)
    assert torch.equal(y.offsets, x.offsets)


@SETTINGS
@given(raggeds(dtype=ANY_DTYPE), st.sampled_from([0, 3]))
def test_to_padded_equals_padding_by_hand(x, fill):
    padded = raggedfn.to_padded(x, fill=fill)
    expected = padded_by_hand(x, fill)
    assert padded.shape == expected.shape and padded.dtype == x.dtype
    assert torch.equal(padded, expected)


@SETTINGS
@given(raggeds(), st.integers(0, 2))
def test_to_padded_to_a_larger_shape(x, extra):
    shape = list(padded_by_hand(x, 0.0).shape)
    for p in ragged_positions(x):
        shape[1 + p] += extra
    padded = raggedfn.to_padded(x, fill=-2.0, shape=shape)
    assert list(padded.shape) == shape
    window = tuple(slice(0, n) for n in padded_by_hand(x, -2.0).shape)
    assert torch.equal(padded[window], padded_by_hand(x, -2.0))
    assert int((padded != -2.0).sum()) <= x.values.numel()


@SETTINGS
@given(raggeds())
def test_mask_equals_per_sample_reference(x):
    positions = ragged_positions(x)
    parts = samples(x)
    extents = [max([t.shape[p] for t in parts], default=0) for p in positions]
    expected = torch.zeros(len(parts), *extents, dtype=torch.bool)
    for i, t in enumerate(parts):
        expected[(i, *(slice(0, t.shape[p]) for p in positions))] = True
    got = raggedfn.mask(x)
    assert got.dtype == torch.bool and torch.equal(got, expected)


@SETTINGS
@given(raggeds())
def test_unbind_and_indexing_equal_the_reference(x):
    assert_same(x, samples(x), rtol=0, atol=0)
    got = raggedfn.unbind(x)
    assert len(got) == x.batch_size
    for i, (a, b) in enumerate(zip(got, samples(x), strict=True)):
        assert torch.equal(a, b) and torch.equal(x[i], b)


@SETTINGS
@given(raggeds(), st.data())
def test_sub_batches_equal_the_picked_samples(x, data):
    picked = (
        data.draw(st.lists(st.integers(0, max(x.batch_size - 1, 0)), max_size=6))
        if x.batch_size
        else []
    )
    sub = x[picked]
    raggedfn.check(sub)
    parts = samples(x)
    assert_same(sub, [parts[i] for i in picked], rtol=0, atol=0)


# ----- interop ----------------------------------------------------------------------------


@SETTINGS
@given(raggeds(num_ragged=1, dim_order="ragged_first", min_batch=1, dtype=FLOATS))
def test_nested_round_trip(x):
    njt = raggedfn.to_nested(x)
    assert njt.size(0) == x.batch_size
    for a, b in zip(njt.unbind(), samples(x), strict=True):
        assert torch.equal(a, b)
    y = raggedfn.from_nested(njt)
    raggedfn.check(y)
    assert_same(y, samples(x), rtol=0, atol=0)


@SETTINGS
@given(raggeds(num_ragged=1, dim_order="ragged_first"))
def test_cu_seqlens_equal_cumulative_lengths(x):
    cu, max_len = raggedfn.cu_seqlens(x)
    lengths = [t.shape[0] for t in samples(x)]
    expected = [0]
    for n in lengths:
        expected.append(expected[-1] + n)
    assert cu.dtype == torch.int32 and cu.tolist() == expected
    assert max_len == max(lengths, default=0)


# ----- pytrees ----------------------------------------------------------------------------


def assert_same_structure(a: Ragged, b: Ragged) -> None:
    assert isinstance(b, Ragged) and a.layout == b.layout
    assert a.values is b.values and a.offsets is b.offsets and a.sizes is b.sizes


@SETTINGS
@given(raggeds())
def test_torch_pytree_round_trip(x):
    tree = {"x": x, "rest": [x, 1.5]}
    leaves, spec = torch_pytree.tree_flatten(tree)
    assert len(leaves) == 7
    assert leaves[0] is x.values and leaves[1] is x.offsets and leaves[2] is x.sizes
    back = torch_pytree.tree_unflatten(leaves, spec)
    assert_same_structure(x, back["x"])
    assert_same_structure(x, back["rest"][0])
    doubled = torch_pytree.tree_map_only(
        torch.Tensor, lambda t: t * 2 if t.is_floating_point() else t, x
    )
    assert isinstance(doubled, Ragged) and doubled.offsets is x.offsets
    paths = [torch_pytree.keystr(k) for k, _ in torch_pytree.tree_flatten_with_path(x)[0]]
    assert paths == [".values", ".offsets", ".sizes"]


@SETTINGS
@given(raggeds())
def test_optree_round_trip_in_both_namespaces(x):
    for namespace in (OPTREE_NAMESPACE, "torch"):
        leaves, spec = optree.tree_flatten({"x": x}, namespace=namespace)
        assert len(leaves) == 3 and leaves[0] is x.values
        assert_same_structure(x, optree.tree_unflatten(spec, leaves)["x"])
    leaves, spec = cxx_pytree.tree_flatten([x, x])
    assert len(leaves) == 6
    assert_same_structure(x, cxx_pytree.tree_unflatten(leaves, spec)[1])
    # without a namespace optree treats Ragged as a leaf: not an accidental registration
    assert optree.tree_leaves(x) == [x]


def test_optree_registration_in_a_fresh_process():
    # an earlier `import torch.testing` would hide a missing registration (DESIGN section 1)
    code = textwrap.dedent(
        """
        import sys
        import optree, torch, raggedfn
        x = raggedfn.from_lengths(torch.arange(5.0), [2, 3])
        for ns in ("raggedfn", "torch"):
            leaves, spec = optree.tree_flatten(x, namespace=ns)
            assert len(leaves) == 3, (ns, leaves)
            y = optree.tree_unflatten(spec, leaves)
            assert isinstance(y, raggedfn.Ragged) and y.values is x.values, ns
        import torch.utils._cxx_pytree as cxx
        leaves, spec = cxx.tree_flatten({"a": x})
        assert len(leaves) == 3
        assert cxx.tree_unflatten(leaves, spec)["a"].layout == x.layout
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# ----- torch.func -------------------------------------------------------------------------


@SETTINGS
@given(raggeds(dtype=FLOATS))
def test_func_grad_through_a_ragged_value(x):
    weights = padded_by_hand(x, 0.0).abs() + 1  # per-position weights, not all ones

    def loss(values):
        return (raggedfn.to_padded(x.with_values(values)).pow(2) * weights).sum()

    grad = torch.func.grad(loss)(x.values)
    # reference: the same loss per sample on hand-cut samples, differentiated by autograd
    leaves = [t.detach().clone().requires_grad_(True) for t in samples(x)]
    expected = []
    for i, t in enumerate(leaves):
        window = weights[(i, *(slice(0, n) for n in t.shape))]
        (g,) = torch.autograd.grad((t.pow(2) * window).sum(), t)
        expected.append(g)
    tol = {"rtol": 1e-5, "atol": 1e-6} if x.dtype == torch.float32 else {}
    assert grad.shape == x.values.shape
    torch.testing.assert_close(grad, pack_like(expected, x), **tol)


# ----- torch.compile ----------------------------------------------------------------------


def _compiled_step(x: Ragged) -> tuple[Ragged, torch.Tensor]:
    total = x.values.shape[0]
    rows = segment_ids(x.offsets, total)
    sums = torch.zeros(x.batch_size, *x.values.shape[1:], dtype=x.dtype).index_add(
        0, rows, x.values
    )
    return x.with_values(torch.sin(x.values) * 2 + 1), sums


COMPILED = torch.compile(_compiled_step, fullgraph=True, dynamic=True)


def test_compile_takes_and_returns_ragged_values_without_recompiling():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    gen = torch.Generator().manual_seed(0)
    # the first batch's sizes (T = 10, B = 3, B + 1 = 4) differ from D = 16 on purpose:
    # dynamo "duck sizes" equal sizes into one symbol and then guards on that equality
    batches = [(3, 5, 2), (4, 2, 7, 3), (2, 9), (6, 3, 4, 2, 5)]
    for lengths in batches:
        values = torch.randn(sum(lengths), 16, generator=gen, dtype=torch.float64)
        x = raggedfn.from_lengths(values, list(lengths))
        out, sums = COMPILED(x)
        assert isinstance(out, Ragged) and out.layout == x.layout
        assert torch.equal(out.offsets, x.offsets) and torch.equal(out.sizes, x.sizes)
        assert_same(out, loop(lambda t: torch.sin(t) * 2 + 1, x))
        assert_same(sums, loop(lambda t: t.sum(0), x))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
