"""Forward mode through every public op equals the per-sample loop's forward mode.

Each test pushes random tangents through an op with ``torch.func.jvp`` or with
``torch.autograd.forward_ad`` dual tensors (drawn) and compares outputs and
output tangents with ``torch.func.jvp`` of torch's op on every sample alone
(``_forward_helpers.check_jvp_against_loop``), on ragged inputs that include
B = 0, B = 1, empty samples and equal lengths. The per-sample references are
the ones the reverse-mode property tests use.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests._forward_helpers import check_jvp_against_loop
from property_tests._pairs_helpers import like, tokens_for
from property_tests.reference import samples
from property_tests.strategies import raggeds
from property_tests.test_attention_props import problems, sdpa_sample
from property_tests.test_nn_props import trailing_dense
from property_tests.test_reduce_props import OPS as REDUCTIONS
from property_tests.test_reduce_props import _sample_dims, reduced_dims
from property_tests.test_select_props import ANY, logical_dims, random_index

FLOATS = st.sampled_from([torch.float64, torch.float32])
SETTINGS = settings(deadline=None, max_examples=30)
FEW = settings(deadline=None, max_examples=15)


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@SETTINGS
@given(data=st.data())
def test_reductions(name, data):
    op, ref, tuples = REDUCTIONS[name]
    x = data.draw(raggeds(dtype=FLOATS))
    dims = data.draw(reduced_dims(x, tuples))
    keepdim = data.draw(st.booleans())
    sample_dims = _sample_dims(x, dims)

    def reference(s):
        if name != "std":
            return ref(s, sample_dims, keepdim)
        # torch 2.13's float32 std forward derivative loses ~eps * |x| / std: on a
        # near-constant sample (values ~1, std ~1e-3) it is off by 5e-4 from the exact
        # tangent, where raggedfn's is off by 2e-6; the reference runs in float64
        return ref(s.double(), sample_dims, keepdim).to(s.dtype)

    check_jvp_against_loop(
        lambda a: op(a, dims, keepdim),
        reference,
        x,
        dual=data.draw(st.booleans()),
        nan_tangent_is_zero=name in ("var", "var0", "std"),
        nan_tangent_as_loop=name == "mean",
    )


@pytest.mark.parametrize("name", ["amax", "amin"])
@FEW
@given(data=st.data())
def test_extremum_ties_share_the_tangent(name, data):
    """Integer-valued rows tie: the tangent is the mean of the tied rows', as torch.amax."""
    op, ref, _ = REDUCTIONS[name]
    x = data.draw(raggeds(dtype=torch.float64))
    x = x.with_values(torch.round(x.values * 2))
    dims = data.draw(reduced_dims(x, True))
    sample_dims = _sample_dims(x, dims)
    check_jvp_against_loop(lambda a: op(a, dims, False), lambda s: ref(s, sample_dims, False), x)


@pytest.mark.parametrize(
    "name", ["softmax", "log_softmax", "cumsum"], ids=["softmax", "log_softmax", "cumsum"]
)
@SETTINGS
@given(data=st.data())
def test_softmax_and_cumsum(name, data):
    op = getattr(raggedfn, name)
    torch_op = getattr(torch, name)
    x = data.draw(raggeds(dtype=FLOATS))
    dim = data.draw(st.integers(1, x.layout.rank))
    check_jvp_against_loop(
        lambda a: op(a, dim), lambda s: torch_op(s, dim - 1), x, dual=data.draw(st.booleans())
    )


def _param(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


@SETTINGS
@given(data=st.data(), dtype=FLOATS, affine=st.booleans())
def test_layer_norm_and_rms_norm_with_parameter_tangents(data, dtype, affine):
    count = data.draw(st.integers(1, 2))
    x = data.draw(trailing_dense(count, dtype))
    x = x.with_values(x.values.detach())
    count = min(count, x.layout.num_dense)
    shape = tuple(x.shape[x.ndim - count :])
    weight = _param(shape, dtype, 2) if affine else None
    bias = _param(shape, dtype, 3) if affine else None
    dual = data.draw(st.booleans())
    check_jvp_against_loop(
        lambda v, w, b: raggedfn.layer_norm(v, shape, w, b, eps=1e-3),
        lambda s, w, b: F.layer_norm(s, shape, w, b, eps=1e-3),
        x,
        weight,
        bias,
        dual=dual,
    )
    check_jvp_against_loop(
        lambda v, w: raggedfn.rms_norm(v, shape, w, eps=1e-3),
        lambda s, w: F.rms_norm(s, shape, w, eps=1e-3),
        x,
        weight,
        dual=dual,
    )


@SETTINGS
@given(data=st.data(), dtype=FLOATS)
def test_linear_with_weight_tangents(data, dtype):
    x = data.draw(trailing_dense(1, dtype))
    x = x.with_values(x.values.detach())
    weight = _param((2, x.shape[-1]), dtype, 0)
    bias = _param((2,), dtype, 1)
    check_jvp_against_loop(raggedfn.linear, F.linear, x, weight, bias)


@SETTINGS
@given(ANY, st.data())
def test_sort_and_topk_values(x, data):
    dim = data.draw(logical_dims(x))
    sample_dim = dim - 1 if dim > 0 else dim
    descending = data.draw(st.booleans())
    dual = data.draw(st.booleans())

    def ref_sort(a):
        out = torch.sort(a, dim=sample_dim, descending=descending, stable=True)
        return out.values, out.indices

    check_jvp_against_loop(
        lambda a: raggedfn.sort(a, dim, descending=descending), ref_sort, x, dual=dual
    )
    axis = x.layout.axes[dim % x.ndim - 1]
    k = data.draw(st.integers(0, 4 if axis.ragged else x.shape[dim]))

    def ref_topk(a):
        kk = min(k, a.shape[sample_dim])
        out = torch.sort(a, dim=sample_dim, descending=descending, stable=True)
        return out.values.narrow(sample_dim, 0, kk), out.indices.narrow(sample_dim, 0, kk)

    check_jvp_against_loop(
        lambda a: raggedfn.topk(a, k, dim, largest=descending), ref_topk, x, dual=dual
    )


@SETTINGS
@given(ANY, st.data())
def test_gather_narrow_and_cat(x, data):
    dim = data.draw(logical_dims(x))
    sample_dim = dim - 1 if dim > 0 else dim
    index = random_index(x, dim, data, broadcast=False)
    check_jvp_against_loop(
        lambda a, i: raggedfn.gather(a, dim, i),
        lambda a, i: torch.gather(a, sample_dim, i),
        x,
        index,
    )
    length = x.shape[dim]
    if length is not None:
        start = data.draw(st.integers(0, length))
        size = data.draw(st.integers(0, length - start))
        check_jvp_against_loop(
            lambda a: raggedfn.narrow(a, dim, start, size),
            lambda a: a.narrow(sample_dim, start, size),
            x,
        )
    y = like(x, seed=3)
    check_jvp_against_loop(
        lambda a, b: raggedfn.cat([a, b], dim),
        lambda a, b: torch.cat([a, b], sample_dim),
        x,
        y,
        dual=data.draw(st.booleans()),
    )


@FEW
@given(raggeds(num_ragged=1, feature_shape=(3,), dtype=FLOATS, dim_order="ragged_first"), st.data())
def test_products_with_two_ragged_operands(x, data):
    y = data.draw(tokens_for(x.batch_size, (3,), x.dtype))
    dual = data.draw(st.booleans())
    check_jvp_against_loop(
        lambda a, b: raggedfn.matmul(a, raggedfn.transpose(b, 1, 2)),
        lambda a, b: a @ b.T,
        x,
        y,
        dual=dual,
    )
    scores = raggedfn.einsum("bnd,bmd->bnm", x, y)
    check_jvp_against_loop(raggedfn.matmul, torch.matmul, scores, y, dual=dual)


@FEW
@given(
    raggeds(num_ragged=2, feature_shape=(3,), dtype=FLOATS, dim_order="ragged_first", square=True)
)
def test_triangle_update(z):
    check_jvp_against_loop(
        lambda a, b: raggedfn.einsum("bikc,bjkc->bijc", a, b),
        lambda a, b: torch.einsum("ikc,jkc->ijc", a, b),
        z,
        like(z, seed=7),
    )


@SETTINGS
@given(problems(), st.booleans(), st.booleans(), st.booleans(), st.booleans())
def test_attention(problem, with_bias, with_padding, causal, dual):
    q, k, v, bias, padding = problem
    b = bias if with_bias else None
    p = padding if with_padding else None
    check_jvp_against_loop(
        lambda q, k, v, b, p: raggedfn.attention(q, k, v, bias=b, key_padding=p, causal=causal),
        lambda q, k, v, b, p: sdpa_sample(q, k, v, b, p, causal),
        q,
        k,
        v,
        b,
        p,
        dual=dual,
    )


@FEW
@given(st.lists(st.integers(0, 4), min_size=0, max_size=3), st.integers(0, 2**31 - 1), FLOATS)
def test_triangle_attention_with_pair_bias(sizes, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    square = torch.tensor([[n, n] for n in sizes], dtype=torch.int64).reshape(-1, 2)
    count = int((square[:, 0] ** 2).sum())

    def make(*feature):
        values = torch.randn(count, *feature, generator=gen, dtype=torch.float64).to(dtype)
        return raggedfn.from_sizes(values, square)

    q, k, v = make(2, 3), make(2, 3), make(2, 3)
    bias = make(2)

    def reference(q, k, v, bias):  # rows i of sample: q[i] [N, H, Dh]
        if q.shape[0] == 0:
            return q.new_zeros(q.shape)
        return torch.stack([sdpa_sample(q[i], k[i], v[i], bias) for i in range(q.shape[0])])

    check_jvp_against_loop(
        lambda q, k, v, b: raggedfn.attention(q, k, v, bias=b), reference, q, k, v, bias
    )


@SETTINGS
@given(raggeds(dtype=FLOATS), st.booleans())
def test_elementwise_and_shape_chain(x, dual):
    y = like(x, seed=5)
    rank = x.layout.rank

    def op(a, b):
        out = raggedfn.where(a > 0, a * b, raggedfn.apply(torch.exp, b))
        return raggedfn.transpose(raggedfn.div(out, 1.5 + b * b), 1, rank)

    def ref(a, b):
        out = torch.where(a > 0, a * b, torch.exp(b))
        return torch.transpose(out / (1.5 + b * b), 0, rank - 1)

    check_jvp_against_loop(op, ref, x, y, dual=dual)


def _jvp(fn, primals, tangents, dual):
    if not dual:
        return torch.func.jvp(fn, primals, tangents)
    with fwAD.dual_level():
        out = fwAD.unpack_dual(
            fn(*(fwAD.make_dual(p, t) for p, t in zip(primals, tangents, strict=True)))
        )
        return out.primal, out.tangent


@SETTINGS
@given(raggeds(num_ragged=1, dtype=FLOATS, dim_order="standard"), st.booleans())
def test_conversions(x, dual):
    """from_padded, to_padded, from_lengths and unbind carry tangents."""
    lengths = x.sizes[:, 0]
    gen = torch.Generator().manual_seed(0)
    width = int(lengths.max()) if x.batch_size else 0
    padded = torch.randn((x.batch_size, width, *x.values.shape[1:]), generator=gen)
    padded = padded.to(x.dtype)

    def through_padding(values, padded):
        tokens = raggedfn.from_lengths(values, lengths)
        total = raggedfn.add(tokens, raggedfn.from_padded(padded, lengths))
        return raggedfn.to_padded(total, fill=0.0)

    def by_hand(values, padded):
        offsets = x.offsets.tolist()
        rows = []
        for b in range(x.batch_size):
            n = offsets[b + 1] - offsets[b]
            real = values[offsets[b] : offsets[b + 1]] + padded[b, :n]
            rows.append(torch.cat([real, torch.zeros_like(padded[b, n:])]))
        return torch.stack(rows) if rows else torch.zeros_like(padded)

    primals = (x.values, padded)
    tangents = tuple(
        torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in primals
    )
    got = _jvp(through_padding, primals, tangents, dual)
    want = torch.func.jvp(by_hand, primals, tangents)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    if not x.batch_size:  # unbind gives no tensors: nothing to differentiate
        return
    pieces = torch.func.jvp(
        lambda v: tuple(raggedfn.unbind(x.with_values(v))), (x.values,), (tangents[0],)
    )[1]
    for piece, expected in zip(pieces, samples(x.with_values(tangents[0])), strict=True):
        torch.testing.assert_close(piece, expected)
