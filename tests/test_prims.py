"""Segment primitives: gradcheck/gradgradcheck (reverse and forward mode), torch.func
composition, empty segments."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.autograd import gradcheck, gradgradcheck
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

from raggedfn import _prims

# Unsorted segment ids with an empty segment (1) and a trailing empty one (4).
SEGMENTS = torch.tensor([0, 0, 2, 2, 2, 3, 0])
NUM = 5
PRESENT = [0, 2, 3]
# Contiguous segments for the scan and padding: lengths 2, 0, 3, 2.
OFFSETS = torch.tensor([0, 2, 2, 5, 7])
SORTED = torch.repeat_interleave(torch.arange(4), OFFSETS.diff(), output_size=7)
STARTS = OFFSETS[SORTED]
POSITIONS = torch.arange(7) - STARTS


def _first(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return pair[0]


# name -> f(values [T, D]) -> output; outputs of empty segments that are not
# finite by policy (mean NaN, max -inf, ...) are left out so finite differences
# can see every output.
PRIMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda v: _prims.segment_sum(v, SEGMENTS, NUM),
    "mean": lambda v: _prims.segment_mean(v, SEGMENTS, NUM)[PRESENT],
    "prod": lambda v: _prims.segment_prod(v, SEGMENTS, NUM),
    "max": lambda v: _first(_prims.segment_max(v, SEGMENTS, NUM))[PRESENT],
    "min": lambda v: _first(_prims.segment_min(v, SEGMENTS, NUM))[PRESENT],
    "softmax": lambda v: _prims.segment_softmax(v, SEGMENTS, NUM),
    "log_softmax": lambda v: _prims.segment_log_softmax(v, SEGMENTS, NUM),
    "logsumexp": lambda v: _prims.segment_logsumexp(v, SEGMENTS, NUM)[PRESENT],
    "cumsum": lambda v: _prims.segment_cumsum(v, STARTS),
    "broadcast": lambda v: _prims.broadcast(v[:NUM], SEGMENTS),
    "pad": lambda v: _prims.pad(v, SORTED, POSITIONS, 4, 3, fill=-1.0),
    "unpad": lambda v: _prims.unpad(
        v.reshape(7, 3)[:6].reshape(2, 3, 3), SORTED % 2, POSITIONS % 3
    ),
}
NAMES = sorted(PRIMS)
# the prims whose empty segments hold a policy value (NaN mean, -inf max/logsumexp)
FULL: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "mean": lambda v: _prims.segment_mean(v, SEGMENTS, NUM),
    "max": lambda v: _first(_prims.segment_max(v, SEGMENTS, NUM)),
    "min": lambda v: _first(_prims.segment_min(v, SEGMENTS, NUM)),
    "logsumexp": lambda v: _prims.segment_logsumexp(v, SEGMENTS, NUM),
}


def _values(dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(7, 3, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_and_gradgradcheck(name: str) -> None:
    values = _values()
    assert gradcheck(PRIMS[name], (values,))
    assert gradgradcheck(PRIMS[name], (values,))


@pytest.mark.parametrize("name", ["max", "min"])
def test_ties_share_the_gradient_like_torch_amax(name: str) -> None:
    # Integer-valued rows tie; finite differences see the even split at a tie.
    values = torch.tensor([[1.0], [1.0], [2.0], [2.0], [0.0], [3.0], [-1.0]], dtype=torch.float64)
    values.requires_grad_(True)
    assert gradcheck(PRIMS[name], (values,))
    out = PRIMS[name](values)
    (got,) = torch.autograd.grad(out.sum(), values)
    torch_fn = torch.amax if name == "max" else torch.amin
    want = torch.zeros_like(values)
    for segment in PRESENT:
        rows = (SEGMENTS == segment).nonzero().squeeze(1)
        part = values[rows]
        (g,) = torch.autograd.grad(torch_fn(part, 0).sum(), part)
        want[rows] = g
    torch.testing.assert_close(got, want)


def test_extrema_identity_and_first_arg() -> None:
    values = torch.tensor([[1.0], [1.0], [2.0], [2.0], [0.0], [3.0], [-1.0]])
    top, arg = _prims.segment_max(values, SEGMENTS, NUM)
    assert top.squeeze(1).tolist() == [1.0, float("-inf"), 2.0, 3.0, float("-inf")]
    assert arg.squeeze(1).tolist() == [0, -1, 2, 5, -1]
    low, arg = _prims.segment_min(values, SEGMENTS, NUM)
    assert low.squeeze(1).tolist() == [-1.0, float("inf"), 0.0, 3.0, float("inf")]
    assert arg.squeeze(1).tolist() == [6, -1, 4, 5, -1]
    ints = values.to(torch.int32)
    top, _ = _prims.segment_max(ints, SEGMENTS, NUM)
    assert top.squeeze(1).tolist()[1] == torch.iinfo(torch.int32).min
    nan = torch.tensor([[1.0], [float("nan")], [2.0]])
    top, arg = _prims.segment_max(nan, torch.tensor([0, 0, 1]), 2)
    assert torch.isnan(top[0]).all() and arg.squeeze(1).tolist() == [1, 2]


def test_empty_segment_values_follow_the_policy() -> None:
    values = _values().detach()
    assert _prims.segment_sum(values, SEGMENTS, NUM)[1].eq(0).all()
    assert _prims.segment_prod(values, SEGMENTS, NUM)[1].eq(1).all()
    assert _prims.segment_mean(values, SEGMENTS, NUM)[1].isnan().all()
    assert _prims.segment_logsumexp(values, SEGMENTS, NUM)[1].eq(float("-inf")).all()
    assert _prims.segment_counts(SEGMENTS, NUM).tolist() == [3, 0, 3, 1, 0]


@pytest.mark.parametrize("name", NAMES)
def test_gradients_finite_with_empty_segments(name: str) -> None:
    # Full outputs (policy NaN/-inf included) with a zero cotangent there.
    f = FULL.get(name, PRIMS[name])
    values = _values()
    out = f(values)
    finite = torch.isfinite(out.detach())
    loss = torch.where(finite, out, torch.zeros_like(out)).pow(2).sum()
    (first,) = torch.autograd.grad(loss, values, create_graph=True)
    assert torch.isfinite(first).all()
    (second,) = torch.autograd.grad(first.sum(), values, allow_unused=True, materialize_grads=True)
    assert torch.isfinite(second).all()


@pytest.mark.parametrize("name", NAMES)
def test_func_grad_vjp_jacrev_match_autograd(name: str) -> None:
    f = PRIMS[name]
    values = _values()
    out = f(values)
    cotangent = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    (want,) = torch.autograd.grad(out, values, cotangent)

    def loss(v: torch.Tensor) -> torch.Tensor:
        return (f(v) * cotangent).sum()

    torch.testing.assert_close(grad(loss)(values.detach()), want)
    _, pullback = vjp(f, values.detach())
    torch.testing.assert_close(pullback(cotangent)[0], want)
    jacobian = jacrev(f)(values.detach())
    full = torch.autograd.functional.jacobian(f, values.detach())
    torch.testing.assert_close(jacobian, full)


@pytest.mark.parametrize("name", NAMES)
def test_grad_of_grad_matches_double_backward(name: str) -> None:
    f = PRIMS[name]
    weight = torch.linspace(-1, 1, 21, dtype=torch.float64).reshape(7, 3)

    def inner(v: torch.Tensor) -> torch.Tensor:
        return f(v).pow(2).sum()

    def outer(v: torch.Tensor) -> torch.Tensor:
        return (grad(inner)(v) * weight).sum()

    values = _values()
    (first,) = torch.autograd.grad(inner(values), values, create_graph=True)
    (want,) = torch.autograd.grad((first * weight).sum(), values)
    torch.testing.assert_close(grad(outer)(values.detach()), want)


@pytest.mark.parametrize("name", NAMES)
def test_vmap_over_leading_axis_and_per_example_grads(name: str) -> None:
    f = PRIMS[name]
    gen = torch.Generator().manual_seed(2)
    batch = torch.randn(4, 7, 3, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(vmap(f)(batch), torch.stack([f(b) for b in batch]))

    def loss(v: torch.Tensor) -> torch.Tensor:
        return f(v).sin().sum()

    per_example = vmap(grad(loss))(batch)
    want = torch.stack([grad(loss)(b) for b in batch])
    torch.testing.assert_close(per_example, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", NAMES)
def test_inputs_unmodified_and_dtype_kept(name: str, dtype: torch.dtype) -> None:
    values = _values(dtype).detach()
    before = values.clone()
    version = values._version
    out = PRIMS[name](values)
    assert values._version == version
    assert torch.equal(values, before)
    assert out.dtype == dtype


def test_softmax_family_matches_composite_reference() -> None:
    values = _values()
    for segment in PRESENT:
        rows = (SEGMENTS == segment).nonzero().squeeze(1)
        torch.testing.assert_close(PRIMS["softmax"](values)[rows], torch.softmax(values[rows], 0))
        torch.testing.assert_close(
            PRIMS["log_softmax"](values)[rows], torch.log_softmax(values[rows], 0)
        )
        torch.testing.assert_close(
            _prims.segment_logsumexp(values, SEGMENTS, NUM)[segment],
            torch.logsumexp(values[rows], 0),
        )


def test_cumsum_restarts_per_segment_and_keeps_precision() -> None:
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    assert _prims.segment_cumsum(values, STARTS).tolist() == [1, 3, 3, 7, 12, 6, 13]
    # A huge prefix before a segment must not swamp it in float32.
    big = torch.tensor([1e8, 1.0, 1e-3, 2e-3, 3e-3], dtype=torch.float32)
    starts = torch.tensor([0, 0, 2, 2, 2])
    out = _prims.segment_cumsum(big, starts)
    torch.testing.assert_close(out[2:], torch.cumsum(big[2:], 0))
    ints = torch.tensor([1, 2, 3], dtype=torch.int32)
    assert _prims.segment_cumsum(ints, torch.tensor([0, 0, 2])).dtype == torch.int64


def test_pad_unpad_round_trip() -> None:
    values = _values().detach()
    padded = _prims.pad(values, SORTED, POSITIONS, 4, 3, fill=-1.0)
    assert padded.shape == (4, 3, 3)
    assert padded[1].eq(-1).all() and padded[0, 2].eq(-1).all()
    torch.testing.assert_close(_prims.unpad(padded, SORTED, POSITIONS), values)


def test_prod_gradients_with_zeros() -> None:
    # Segment 0: one zero; segment 2: two zeros; segment 3: none.
    values = torch.tensor(
        [[0.0, 2.0], [3.0, 0.0], [0.0, 1.5], [0.0, -2.0], [2.0, 0.5], [4.0, 3.0], [-1.5, 0.7]],
        dtype=torch.float64,
        requires_grad=True,
    )
    assert gradcheck(PRIMS["prod"], (values,))
    assert gradgradcheck(PRIMS["prod"], (values,))
    out = PRIMS["prod"](values)
    (got,) = torch.autograd.grad(out.sum(), values)
    want = torch.zeros_like(values)
    for segment in PRESENT:
        rows = (SEGMENTS == segment).nonzero().squeeze(1)
        part = values[rows]
        (g,) = torch.autograd.grad(torch.prod(part, 0).sum(), part)
        want[rows] = g
    torch.testing.assert_close(got, want)
    assert vmap(grad(lambda v: PRIMS["prod"](v).sum()))(values.detach()[None]).isfinite().all()


# ----- forward mode ------------------------------------------------------------------------


def _forward_checks(
    f: Callable[[torch.Tensor], torch.Tensor], values: torch.Tensor, second: bool = True
) -> None:
    """Forward-mode derivatives against finite differences, batched (vmap of jvp), and
    forward-over-reverse second derivatives (``second``)."""
    assert gradcheck(
        f,
        (values,),
        check_forward_ad=True,
        check_backward_ad=False,
        check_batched_forward_grad=True,
    )
    if second:
        assert gradgradcheck(f, (values,), check_fwd_over_rev=True)


@pytest.mark.parametrize("name", NAMES)
def test_forward_mode_gradcheck(name: str) -> None:
    _forward_checks(PRIMS[name], _values())


@pytest.mark.parametrize("name", ["max", "min"])
def test_forward_mode_at_ties_is_the_mean_tangent(name: str) -> None:
    values = torch.tensor([[1.0], [1.0], [2.0], [2.0], [0.0], [3.0], [-1.0]], dtype=torch.float64)
    # first order only: finite differences of the gradient jump across a tie
    _forward_checks(PRIMS[name], values.requires_grad_(True), second=False)
    tangent = torch.arange(7, dtype=torch.float64).reshape(7, 1)
    _, got = jvp(PRIMS[name], (values.detach(),), (tangent,))
    tied = [0.5, 2.5, 5.0] if name == "max" else [6.0, 4.0, 5.0]  # segments 0, 2, 3
    assert got.squeeze(1).tolist() == tied


def test_forward_mode_of_prod_with_zeros() -> None:
    values = torch.tensor(
        [[0.0, 2.0], [3.0, 0.0], [0.0, 1.5], [0.0, -2.0], [2.0, 0.5], [4.0, 3.0], [-1.5, 0.7]],
        dtype=torch.float64,
        requires_grad=True,
    )
    _forward_checks(PRIMS["prod"], values)


@pytest.mark.parametrize("name", NAMES)
def test_jacfwd_equals_jacrev_and_jvp_equals_forward_ad(name: str) -> None:
    f = PRIMS[name]
    values = _values().detach()
    torch.testing.assert_close(jacfwd(f)(values), jacrev(f)(values))
    tangent = torch.randn(
        values.shape, dtype=values.dtype, generator=torch.Generator().manual_seed(3)
    )
    out, got = jvp(f, (values,), (tangent,))
    with fwAD.dual_level():
        dual = fwAD.unpack_dual(f(fwAD.make_dual(values, tangent)))
    torch.testing.assert_close(dual.primal, out)
    torch.testing.assert_close(dual.tangent, got)


@pytest.mark.parametrize("name", NAMES)
def test_hessian_equals_reverse_over_reverse(name: str) -> None:
    f = PRIMS[name]

    def loss(v: torch.Tensor) -> torch.Tensor:
        return f(v).sin().sum()

    values = _values().detach()
    torch.testing.assert_close(hessian(loss)(values), jacrev(jacrev(loss))(values))
    torch.testing.assert_close(jacrev(jacfwd(loss))(values), jacrev(jacrev(loss))(values))


@pytest.mark.parametrize("name", NAMES)
def test_forward_tangents_finite_with_empty_segments(name: str) -> None:
    """Except the mean's: NaN for an empty segment, as torch.mean's of an empty tensor
    (tests/test_prims_mean.py compares it with torch)."""
    values = _values().detach()
    _, tangent = jvp(FULL.get(name, PRIMS[name]), (values,), (torch.ones_like(values),))
    if name == "mean":
        empty = _prims.segment_counts(SEGMENTS, NUM) == 0
        assert tangent[empty].isnan().all() and tangent[~empty].isfinite().all()
        return
    assert torch.isfinite(tangent).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softmax_family_subtracts_the_segment_maximum(dtype: torch.dtype) -> None:
    """exp(1000) overflows and exp(-1000) underflows in both dtypes: only the shift by the
    segment maximum gives logsumexp 1000 + log 2 and -1000, and softmax 1/2, 1/2, 1."""
    values = torch.tensor([1000.0, 1000.0, -1000.0], dtype=dtype)
    segments = torch.tensor([0, 0, 1])
    lse = _prims.segment_logsumexp(values, segments, 2)
    want = torch.tensor([1000.0 + torch.log(torch.tensor(2.0)).item(), -1000.0], dtype=dtype)
    torch.testing.assert_close(lse, want)
    half = torch.tensor([0.5, 0.5, 1.0], dtype=dtype)
    torch.testing.assert_close(_prims.segment_softmax(values, segments, 2), half)
    torch.testing.assert_close(_prims.segment_log_softmax(values, segments, 2), half.log())


def test_every_reduction_equals_torch_per_segment_and_the_empty_policy() -> None:
    """Values of each reduction, segment by segment (unsorted ids, empty segments 1 and 4)."""
    values = _values().detach()
    empty = {"sum": 0.0, "mean": float("nan"), "prod": 1.0, "amax": -math.inf, "amin": math.inf}
    results = {
        "sum": _prims.segment_sum(values, SEGMENTS, NUM),
        "mean": _prims.segment_mean(values, SEGMENTS, NUM),
        "prod": _prims.segment_prod(values, SEGMENTS, NUM),
        "amax": _prims.segment_amax(values, SEGMENTS, NUM),
        "amin": _prims.segment_amin(values, SEGMENTS, NUM),
    }
    (maxima, argmax), (minima, argmin) = (
        _prims.segment_max(values, SEGMENTS, NUM),
        _prims.segment_min(values, SEGMENTS, NUM),
    )
    for segment in range(NUM):
        rows = (SEGMENTS == segment).nonzero().squeeze(1)
        for name, out in results.items():
            if segment in PRESENT:
                want = getattr(torch, name)(values[rows], 0)
            else:
                want = torch.full((3,), empty[name], dtype=values.dtype)
            torch.testing.assert_close(out[segment], want, equal_nan=True, msg=name)
        if segment in PRESENT:
            assert torch.equal(argmax[segment], rows[values[rows].argmax(0)])
            assert torch.equal(argmin[segment], rows[values[rows].argmin(0)])
        else:
            assert argmax[segment].eq(-1).all() and argmin[segment].eq(-1).all()
    assert torch.equal(maxima, results["amax"]) and torch.equal(minima, results["amin"])
    counts = _prims.segment_counts(SEGMENTS, NUM)
    assert counts.tolist() == [3, 0, 3, 1, 0]
    torch.testing.assert_close(
        _prims.segment_mean(values, SEGMENTS, NUM, counts), results["mean"], equal_nan=True
    )


def test_cumsum_keeps_infinities_inside_their_segment() -> None:
    inf = math.inf
    values = torch.tensor([1.0, -inf, 2.0, inf, -inf, 5.0, math.nan], dtype=torch.float32)
    out = _prims.segment_cumsum(values, STARTS)
    want = torch.cat([torch.cumsum(values[a:b].double(), 0) for a, b in ((0, 2), (2, 5), (5, 7))])
    torch.testing.assert_close(out, want.float(), equal_nan=True)
    assert out.dtype == torch.float32
    finite = torch.tensor([2.0, -inf, 3.0, 4.0], dtype=torch.float64)
    assert _prims.segment_cumsum(finite, torch.tensor([0, 0, 2, 2])).tolist() == [2, -inf, 3, 7]
    tail = torch.tensor([inf, 1.0, inf, -2.0])  # +inf then only +inf: inf, not NaN
    assert _prims.segment_cumsum(tail, torch.tensor([0, 1, 1, 1])).tolist() == [inf, 1, inf, inf]


def test_pad_default_fill_and_unpad_with_length_unlike_the_feature_size() -> None:
    values = _values().detach()  # [7, 3]; padded length 4 differs from the 3 features
    padded = _prims.pad(values, SORTED, POSITIONS, 4, 4)
    assert padded.shape == (4, 4, 3)
    assert padded[1].eq(0).all() and padded[0, 2:].eq(0).all() and padded[2, 3].eq(0).all()
    torch.testing.assert_close(_prims.unpad(padded, SORTED, POSITIONS), values)
    torch.testing.assert_close(padded[2, :3], values[2:5])


def test_integer_product_takes_the_plain_path() -> None:
    values = torch.tensor([[2, 3], [4, 5], [1, -1], [3, 2], [5, 5], [7, 1], [6, 2]])
    out = _prims.segment_prod(values, SEGMENTS, NUM)
    assert out.dtype == torch.int64
    assert out.tolist() == [[48, 30], [1, 1], [15, -10], [7, 1], [1, 1]]


# ----- segment_softmax with sorted bounds: the segment_reduce path and the general one -----


def _bounded(lengths: list[int], rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    from raggedfn._index import offsets_of, segment_bounds

    offsets = offsets_of(torch.tensor(lengths, dtype=torch.int64))
    segments, bounds = segment_bounds(offsets, rows.shape[0])
    return segments, bounds, len(lengths)


@pytest.mark.parametrize("limit", [0, 10**9])  # general path; segment_reduce path
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softmax_with_bounds_equals_torch_per_segment(limit, dtype, monkeypatch) -> None:
    from raggedfn._prims import _softmax

    monkeypatch.setattr(_softmax, "SEGMENT_REDUCE_MAX", limit)
    lengths = [3, 0, 1, 4, 0, 2]
    inf, nan = float("inf"), float("nan")
    values = torch.randn(10, 2, dtype=dtype)
    values[0, 0] = 1000.0  # only the shift by the segment maximum keeps this finite
    values[3, 1] = -inf  # a whole segment of -inf: NaN, as torch
    values[4:6, 1] = -inf  # -inf beside finite rows: 0
    values[9, 1] = nan
    segments, bounds, num = _bounded(lengths, values)
    got = _prims.segment_softmax(values, segments, num, bounds)
    want = torch.cat([part.softmax(0) for part in values.split(lengths)])
    torch.testing.assert_close(got, want, equal_nan=True)
    # +inf: NaN throughout its segment's column (exp(inf - inf)), as torch, on both paths
    values[7, 0] = inf
    want = torch.cat([part.softmax(0) for part in values.split(lengths)])
    assert want[4:8, 0].isnan().all() and not want[4:8, 1].isnan().any()
    general = _prims.segment_softmax(values, segments, num)
    torch.testing.assert_close(general, want, equal_nan=True)
    torch.testing.assert_close(
        _prims.segment_softmax(values, segments, num, bounds), want, equal_nan=True
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softmax_per_segment_path_forward_and_first_order_backward(dtype, monkeypatch) -> None:
    """Long segments (here: every segment, the threshold lowered) run torch's own softmax
    kernels once per segment, forward and first-order backward; equal to torch per
    segment, with empty segments and a large value only the shift keeps finite."""
    from raggedfn._prims import _softmax

    monkeypatch.setattr(_softmax, "PER_SEGMENT_MIN", 0)
    taken: list[bool] = []
    real = _softmax._per_segment

    def spy(*args):  # type: ignore[no-untyped-def]
        host = real(*args)
        taken.append(host is not None)
        return host

    monkeypatch.setattr(_softmax, "_per_segment", spy)
    lengths = [3, 0, 1, 4, 0, 2]
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(10, 2, dtype=dtype, generator=gen)
    values[0, 0] = 1000.0
    grad = torch.randn(10, 2, dtype=dtype, generator=gen)
    segments, bounds, num = _bounded(lengths, values)
    x = values.clone().requires_grad_()
    got = _prims.segment_softmax(x, segments, num, bounds)
    (got_grad,) = torch.autograd.grad(got, x, grad)
    ref = values.clone().requires_grad_()
    want = torch.cat([part.softmax(0) for part in ref.split(lengths)])
    (want_grad,) = torch.autograd.grad(want, ref, grad)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)
    assert taken == [True, True]  # the forward and the backward, per segment


@pytest.mark.parametrize("limit", [0, 10**9])
def test_softmax_with_bounds_gradients(limit, monkeypatch) -> None:
    from raggedfn._prims import _softmax

    monkeypatch.setattr(_softmax, "SEGMENT_REDUCE_MAX", limit)
    values = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    segments, bounds, num = _bounded([2, 0, 5], values)

    def f(v: torch.Tensor) -> torch.Tensor:
        return _prims.segment_softmax(v, segments, num, bounds)

    assert gradcheck(f, (values,))
    assert gradgradcheck(f, (values,))
    want = torch.cat([part.softmax(0) for part in values.split([2, 0, 5])])
    cotangent = torch.randn(7, 3, dtype=torch.float64)
    torch.testing.assert_close(
        torch.autograd.grad(f(values), values, cotangent)[0],
        torch.autograd.grad(want, values, cotangent)[0],
    )


@pytest.mark.parametrize(
    "offsets", [[0, 2, 9], [0, 4, 2], [0, -3, 5], [0, 2**62, 5], [0, 1], [2, 3, 5]]
)
def test_softmax_with_bounds_of_malformed_offsets(offsets, monkeypatch) -> None:
    """Bounds stay within the rows (``segment_reduce`` trusts its offsets and would read
    out of bounds), and both paths answer alike: the same values, or both refuse rows
    past the last sample."""
    from raggedfn._index import segment_bounds
    from raggedfn._prims import _softmax

    values = torch.randn(5, 2)
    segments, bounds = segment_bounds(torch.tensor(offsets), 5)
    assert int(bounds[0]) == 0 and bool((bounds.diff() >= 0).all()) and int(bounds[-1]) <= 5
    answers = []
    for limit in (0, 10**9):
        monkeypatch.setattr(_softmax, "SEGMENT_REDUCE_MAX", limit)
        try:
            answers.append(_prims.segment_softmax(values, segments, len(offsets) - 1, bounds))
        except (IndexError, RuntimeError):
            answers.append(None)
    if answers[0] is None or answers[1] is None:
        assert answers == [None, None]
    else:
        torch.testing.assert_close(answers[1], answers[0])


# block (start, stop, rows) covering [0, 17): a 2 x 3 block, an empty one, 4 x 2 and 1 x 3
BLOCKS = ((0, 6, 2), (6, 6, 1), (6, 14, 4), (14, 17, 1))


def _block_softmax_loop(values: torch.Tensor) -> torch.Tensor:
    """Each block alone: torch.softmax over its columns."""
    rest = values.shape[1:]
    return torch.cat(
        [
            values[a:b].reshape(rows, -1, *rest).softmax(1).reshape(b - a, *rest)
            for a, b, rows in BLOCKS
        ]
    )


@pytest.mark.parametrize("create_graph", [False, True])
def test_block_softmax_equals_the_per_block_loop_with_and_without_a_graph(create_graph):
    """Forward, the fused first-order backward and the recorded backward (create_graph)."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(17, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    cotangent = torch.randn(17, 2, generator=gen, dtype=torch.float64)
    got = _prims.block_softmax(values, BLOCKS)
    want = _block_softmax_loop(values)
    torch.testing.assert_close(got, want)
    (dgot,) = torch.autograd.grad(got, values, cotangent, create_graph=create_graph)
    (dwant,) = torch.autograd.grad(want, values, cotangent, create_graph=create_graph)
    torch.testing.assert_close(dgot, dwant)
    assert dgot.requires_grad == create_graph
    if create_graph:  # the recorded backward is differentiable again, as the loop's
        w = torch.randn(17, 2, generator=gen, dtype=torch.float64)
        torch.testing.assert_close(
            torch.autograd.grad(dgot, values, w)[0], torch.autograd.grad(dwant, values, w)[0]
        )


def test_block_softmax_gradcheck_and_gradgradcheck():
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(17, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda v: _prims.block_softmax(v, BLOCKS), (values,))
    assert gradgradcheck(lambda v: _prims.block_softmax(v, BLOCKS), (values,))


@pytest.mark.parametrize("over", [0, 1])
def test_softmax_segment_reduce_limit_is_inclusive(over, monkeypatch) -> None:
    """``SEGMENT_REDUCE_MAX`` elements take segment_reduce ("up to this many"), one more
    the general path; both equal torch.softmax per segment."""
    from raggedfn._prims import _softmax

    values = torch.randn(7, 3, dtype=torch.float64)
    segments, bounds, num = _bounded([2, 0, 5], values)
    monkeypatch.setattr(_softmax, "SEGMENT_REDUCE_MAX", values.numel() - over)
    calls: list[str] = []
    original = torch.segment_reduce

    def spy(*args, **kwargs):
        calls.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "segment_reduce", spy)
    got = _prims.segment_softmax(values, segments, num, bounds)
    torch.testing.assert_close(got, torch.cat([p.softmax(0) for p in values.split([2, 0, 5])]))
    assert calls == ([] if over else ["max", "sum"])
