"""Reductions, softmax, logsumexp and attention at numerical extremes equal torch's own op.

Values come from ``strategies.extreme_values``: +-1e3 magnitudes, values near +-1e3
(``exp`` overflows or underflows unless the maximum is subtracted), ``-inf``
entries, all-equal values, ties and subnormal numbers, in float32 and float64.
The reference is torch's op on every sample alone. Where torch's result is
finite ours must be finite and close; where it is not, ours must be the same
``inf``/``NaN`` (reductions over an empty extent follow DESIGN §4 as in
``test_reduce_props``). Gradients are compared where torch's gradient is finite.

Tolerances follow the magnitude of the inputs: ``n * eps * scale**degree`` for
an op of the given degree (a sum of ``n`` values of size ``scale`` in another
order differs by that much); extrema and arg-extrema are exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests.reference import pack_like, samples
from property_tests.strategies import (
    EXTREMES,
    NON_FINITE,
    VALUE_KINDS,
    extreme_values,
    raggeds,
)
from property_tests.test_attention_props import check_problem
from property_tests.test_reduce_props import OPS, _policy, _sample_dims, reduced_dims

FLOATS = st.sampled_from([torch.float64, torch.float32])
SETTINGS = settings(deadline=None, max_examples=60)

# degree of each op in its input (None: compare relatively, e.g. products)
DEGREE: dict[str, int | None] = {
    "sum": 1,
    "mean": 1,
    "amax": 0,
    "amin": 0,
    "logsumexp": 1,
    "prod": None,
    "var": 2,
    "var0": 2,
    "std": 1,
    "norm2": 1,
    "norm1": 1,
    "norm3": 1,
    "norm0": 0,
    "norm_inf": 0,
    "norm_-inf": 0,
    "softmax": 1,
    "log_softmax": 1,
    "cumsum": 1,
}
EXACT = {"amax", "amin", "norm0", "norm_inf", "norm_-inf", "argmax", "argmin"}


def _scale(t: torch.Tensor) -> float:
    finite = t.detach()[torch.isfinite(t.detach())]
    return max(1.0, float(finite.abs().max())) if finite.numel() else 1.0


def _tolerance(name: str, x: raggedfn.Ragged, grad: bool = False) -> dict[str, float]:
    if name in EXACT and not grad:
        return {"rtol": 0.0, "atol": 0.0}
    eps = torch.finfo(x.dtype).eps
    count = max(1, x.values.numel())  # at most this many terms meet in one result
    degree = DEGREE[name]
    if degree is None:  # products: relative only, down to the smallest normal number
        # a gradient is a cotangent (|c| < 4 or so) times a product that may underflow in
        # one order of multiplication and not in another: the floor scales with |c|
        return {"rtol": 4 * count * eps, "atol": torch.finfo(x.dtype).tiny * (4 if grad else 1)}
    # a gradient moves by eps * scale wherever the op subtracts or exponentiates its inputs
    # (softmax-like gradients exp(x - lse)); the cotangents are randn (|c| < 4 or so)
    power = 1 if grad else degree
    bound = 4 * count * eps * _scale(x.values) ** power * (4 if grad else 1)
    return {"rtol": 4 * count * eps, "atol": bound}


def _assert_matches(
    got: torch.Tensor, want: torch.Tensor, what: str, gradient: bool = False, **tol: float
) -> None:
    """Close where ``want`` is finite (and ``got`` finite there); identical non-finite values,
    except for a gradient (torch's NaN slope at -inf is ours 0: DESIGN §4 keeps them finite)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    finite = torch.isfinite(want)
    assert torch.isfinite(got[finite]).all(), f"{what}: non-finite where torch is finite"
    torch.testing.assert_close(got[finite], want[finite], msg=lambda m: f"{what}: {m}", **tol)
    if want.is_floating_point() and not gradient:
        same = (got[~finite] == want[~finite]) | (got[~finite].isnan() & want[~finite].isnan())
        assert same.all(), f"{what}: {got[~finite]} where torch gives {want[~finite]}"


def _per_sample(result: Any) -> list[torch.Tensor]:
    if isinstance(result, raggedfn.Ragged):
        return samples(result)
    return list(result.unbind(0))


def _compare(
    name: str,
    op: Callable[..., Any],
    ref: Callable[..., torch.Tensor],
    x: raggedfn.Ragged,
    seed: int,
) -> None:
    """Values of ``op(x)`` vs ``ref`` per sample; gradients where torch's are finite."""
    result = op(x)
    per_sample = [s.detach().requires_grad_(x.values.requires_grad) for s in samples(x)]
    expected = [ref(s) for s in per_sample]
    got = _per_sample(result)
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        _assert_matches(g.detach(), e.detach(), f"{name} sample {i}", **_tolerance(name, x))
    if not x.values.requires_grad or name in EXACT - {"amax", "amin"}:
        return
    gen = torch.Generator().manual_seed(seed)
    cotangents = [torch.randn(e.shape, generator=gen, dtype=torch.float64) for e in expected]
    # only outputs finite on both sides enter the loss (an inf output has no usable slope)
    masks = [torch.isfinite(e.detach()) & torch.isfinite(g.detach()) for e, g in zip(expected, got, strict=True)]  # fmt: skip

    def loss(outs: list[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for out, cot, mask in zip(outs, cotangents, masks, strict=True):
            total = total + torch.where(mask, out.double() * cot, 0.0).sum()
        return total

    want_loss, got_loss = loss(expected), loss(got)
    if not want_loss.requires_grad:
        return
    want = torch.autograd.grad(want_loss, per_sample, allow_unused=True, materialize_grads=True)
    (mine,) = torch.autograd.grad(got_loss, x.values, allow_unused=True, materialize_grads=True)
    _assert_matches(mine, pack_like(want, x), f"{name} gradient", True, **_tolerance(name, x, True))


REDUCTIONS = sorted(OPS)
# p-norms with p > 1 raise |x| to the power p before summing: subnormal values underflow to
# a zero norm and a zero gradient, as torch's vector_norm over two or more elements; over a
# single element torch returns |x| exactly (gradient sign(x)), ours 0 (pinned below).
SUBNORMAL_NORMS = {"norm2", "norm3"}


@pytest.mark.parametrize("name", REDUCTIONS)
@SETTINGS
@given(data=st.data())
def test_reduction_at_extremes_matches_torch(name: str, data: st.DataObject) -> None:
    op, ref, tuples = OPS[name]
    kinds = EXTREMES
    if name in SUBNORMAL_NORMS:  # known: |x|**p underflows (test_norm_of_subnormal_values)
        kinds = st.sampled_from([k for k in VALUE_KINDS[1:] if k != "subnormal"])
    x = data.draw(raggeds(dtype=FLOATS, requires_grad=True, values=kinds))
    dims = data.draw(reduced_dims(x, tuples))
    keepdim = data.draw(st.booleans())
    sample_dims = _sample_dims(x, dims)
    _compare(
        name,
        lambda x: op(x, dims, keepdim),
        lambda s: ref(s, sample_dims, keepdim),
        x,
        data.draw(st.integers(0, 2**16)),
    )


@pytest.mark.parametrize("name", ["argmax", "argmin"])
@SETTINGS
@given(data=st.data())
def test_arg_reduction_at_extremes_matches_torch(name: str, data: st.DataObject) -> None:
    x = data.draw(raggeds(dtype=FLOATS, values=EXTREMES))
    dims = data.draw(reduced_dims(x, False))
    keepdim = data.draw(st.booleans())
    torch_fn = getattr(torch, name)
    ref = _policy(name, lambda s, d, k: torch_fn(s, d, keepdim=k))
    sample_dims = _sample_dims(x, dims)
    op = getattr(raggedfn, name)
    _compare(name, lambda x: op(x, dims, keepdim), lambda s: ref(s, sample_dims, keepdim), x, 0)


@pytest.mark.parametrize("p", [2, 3])
def test_norm_of_subnormal_values_underflows_as_torch_except_one_element(p: int) -> None:
    """Two subnormals: torch and ours underflow alike. One: torch gives |x| (xfail below)."""
    values = torch.tensor([8.344e-309, -4e-309], dtype=torch.float64, requires_grad=True)
    out = raggedfn.norm(raggedfn.from_list([values]), p, 1)
    (got,) = torch.autograd.grad(out.sum(), values)
    leaf = values.detach().clone().requires_grad_(True)
    want = torch.linalg.vector_norm(leaf, p)
    torch.testing.assert_close(out, want.reshape(1).detach(), rtol=1e-6, atol=0.0)
    torch.testing.assert_close(got, torch.autograd.grad(want, leaf)[0])


@pytest.mark.xfail(strict=True, reason="known: |x|**p of one subnormal underflows; torch: |x|")
@pytest.mark.parametrize("p", [2, 3])
def test_norm_of_one_subnormal_value(p: int) -> None:
    values = torch.tensor([8.344e-309], dtype=torch.float64, requires_grad=True)
    out = raggedfn.norm(raggedfn.from_list([values]), p, 1)
    torch.testing.assert_close(out.detach(), values.detach().abs(), rtol=1e-6, atol=0.0)


NORMALISE: dict[str, tuple[Callable[..., Any], Callable[..., torch.Tensor]]] = {
    "softmax": (raggedfn.softmax, torch.softmax),
    "log_softmax": (raggedfn.log_softmax, torch.log_softmax),
    "cumsum": (raggedfn.cumsum, torch.cumsum),
}


@pytest.mark.parametrize("name", sorted(NORMALISE))
@SETTINGS
@given(data=st.data())
def test_softmax_and_cumsum_at_extremes_match_torch(name: str, data: st.DataObject) -> None:
    op, torch_op = NORMALISE[name]
    x = data.draw(raggeds(dtype=FLOATS, requires_grad=True, values=EXTREMES))
    if data.draw(st.booleans()):  # a ragged axis for sure (the segment kernels)
        dim = data.draw(st.sampled_from(x.ragged_dims))
    else:
        dim = data.draw(st.integers(1, x.layout.rank))
    sample_dim = dim - 1
    _compare(
        name,
        lambda x: op(x, dim),
        lambda s: torch_op(s, sample_dim),
        x,
        data.draw(st.integers(0, 2**16)),
    )


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "logsumexp"])
@SETTINGS
@given(data=st.data())
def test_softmax_family_with_inf_and_nan_matches_torch(name: str, data: st.DataObject) -> None:
    """+inf, -inf and NaN entries: torch subtracts the raw max, so a slice holding +inf, a
    NaN or only -inf is NaN throughout (logsumexp: +inf, NaN, -inf); ours the same."""
    x = data.draw(raggeds(dtype=FLOATS, requires_grad=True, values=NON_FINITE))
    seed = data.draw(st.integers(0, 2**16))
    if name == "logsumexp":
        op, ref, _ = OPS[name]
        dims = data.draw(reduced_dims(x, True))
        keepdim = data.draw(st.booleans())
        sample_dims = _sample_dims(x, dims)
        _compare(name, lambda x: op(x, dims, keepdim), lambda s: ref(s, sample_dims, keepdim), x, seed)  # fmt: skip
        return
    op, torch_op = NORMALISE[name]
    dim = data.draw(st.sampled_from([*x.ragged_dims, *range(1, x.layout.rank + 1)]))
    _compare(name, lambda x: op(x, dim), lambda s: torch_op(s, dim - 1), x, seed)


def test_logsumexp_and_softmax_of_large_equal_values_do_not_overflow() -> None:
    """The issue's first planted bug: without the max subtraction, exp(1000) is inf."""
    for dtype in (torch.float32, torch.float64):
        x = raggedfn.from_list(
            [torch.tensor([1000.0, 1000.0], dtype=dtype), torch.tensor([-1000.0], dtype=dtype)]
        )
        want = torch.tensor([1000.0 + math.log(2.0), -1000.0], dtype=dtype)
        torch.testing.assert_close(raggedfn.logsumexp(x, 1), want)
        torch.testing.assert_close(
            raggedfn.softmax(x, 1).values, torch.tensor([0.5, 0.5, 1.0], dtype=dtype)
        )
        torch.testing.assert_close(raggedfn.log_softmax(x, 1).values, torch.tensor([-math.log(2.0)] * 2 + [0.0], dtype=dtype))  # fmt: skip


# ----- attention --------------------------------------------------------------------------

HEADS, DIM = 2, 3
# q and k: kinds whose logits stay exact enough to compare (+-1e3 logits come from the bias
# and from the scale); v and the bias: every kind (-inf only in the bias: a masked key)
QK_KINDS = st.sampled_from(["normal", "all_equal", "ties", "subnormal"])
V_KINDS = st.sampled_from(["normal", "large", "shifted", "all_equal", "ties", "subnormal"])


@st.composite
def extreme_attention(draw: Any) -> tuple[Any, ...]:
    dtype = draw(FLOATS)
    n_lengths = draw(st.lists(st.integers(0, 5), min_size=0, max_size=4))
    same = draw(st.booleans())
    m_lengths = list(n_lengths) if same else draw(st.lists(st.integers(0, 5), min_size=len(n_lengths), max_size=len(n_lengths)))  # fmt: skip
    seed = draw(st.integers(0, 2**31 - 1))

    def make(lengths: list[int], kind: str, last: int, offset: int) -> raggedfn.Ragged:
        values = extreme_values((sum(lengths), HEADS, last), dtype, seed + offset, kind)
        if kind == "ties":  # +-500-multiples as q and k would give 1e6 logits: scale down
            values = values / 1e3
        return raggedfn.from_lengths(values, torch.tensor(lengths, dtype=torch.int64))

    q = make(n_lengths, draw(QK_KINDS), DIM, 0)
    k = make(m_lengths, draw(QK_KINDS), DIM, 1)
    v = make(m_lengths, draw(V_KINDS), DIM + 1, 2)
    pair_sizes = torch.tensor(list(zip(n_lengths, m_lengths, strict=True)), dtype=torch.int64)
    count = sum(a * b for a, b in zip(n_lengths, m_lengths, strict=True))
    bias_kind = draw(st.sampled_from(["large", "shifted", "neg_inf", "all_equal", "ties"]))
    bias_values = extreme_values((count, HEADS), dtype, seed + 3, bias_kind)
    bias = raggedfn.from_sizes(bias_values, pair_sizes.reshape(-1, 2))
    gen = torch.Generator().manual_seed(seed + 4)
    padding = raggedfn.from_lengths(
        torch.rand(sum(m_lengths), generator=gen) < 0.4, torch.tensor(m_lengths, dtype=torch.int64)
    )
    return q, k, v, bias, padding


def _attention_tolerance(
    q: Any, k: Any, v: Any, bias: Any, scale: float | None
) -> dict[str, float]:
    """Logit error ``eps * (|q| |k| Dh scale + |bias|)`` moves the output by that times ``|v|``."""
    eps = torch.finfo(q.dtype).eps
    factor = scale if scale is not None else 1 / math.sqrt(DIM)
    logits = _scale(q.values) * _scale(k.values) * DIM * factor + (
        _scale(bias.values) if bias is not None else 0.0
    )
    error = 16 * eps * logits * (1 + max(k.values.shape[0], 1))
    atol = error * _scale(v.values)
    # gradients: dv = P^T dO and the bias's dS move by that error times the loss weights
    # (randn, |w| < 4); dq = scale dS k and dk = scale dS^T q carry scale |k| and scale |q|
    # on top (with scale 30 and keys at -1e3 the output's bound alone was 8-24x too tight)
    lever = max(1.0, factor * _scale(q.values), factor * _scale(k.values))
    return {"rtol": error, "atol": atol, "grad_atol": 4 * atol * lever}


@settings(deadline=None, max_examples=60)
@given(
    extreme_attention(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.sampled_from([None, 0.01, 30.0]),
)
def test_attention_at_extremes_matches_per_sample_sdpa(
    problem, with_bias, with_padding, causal, scale
):
    """Every eager path (per-sample views/copies, buckets, equal lengths) via both bucket plans."""
    q, k, v, bias, _ = problem
    tolerance = _attention_tolerance(q, k, v, bias if with_bias else None, scale)
    check_problem(problem, with_bias, with_padding, causal, scale, **tolerance)
