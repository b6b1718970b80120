"""Reductions equal the per-sample loop, in values and in gradients.

The reference for each op is torch's own op on every sample (cut out by
``reference.samples``). Where torch has no answer for an empty reduction
(``amax`` of an empty tensor raises, for instance) the reference returns the
documented policy of DESIGN §4 instead, written out below.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests.reference import assert_same, pack_like, samples
from property_tests.strategies import raggeds

FLOATS = st.sampled_from([torch.float64, torch.float32])
SETTINGS = settings(deadline=None, max_examples=40)

# Policy for reductions over an empty extent where torch raises (DESIGN §4).
EMPTY_POLICY: dict[str, float] = {
    "amax": -math.inf,
    "amin": math.inf,
    "argmax": -1,
    "argmin": -1,
    "norm_inf": 0.0,
    "norm_-inf": math.inf,
}


def _dims(dims: int | tuple[int, ...]) -> tuple[int, ...]:
    return (dims,) if isinstance(dims, int) else dims


def _policy(name: str, torch_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torch's op, or the documented policy where the reduced extent is empty."""

    def ref(s: torch.Tensor, dims: Any, keepdim: bool) -> torch.Tensor:
        if name in EMPTY_POLICY and any(s.shape[d] == 0 for d in _dims(dims)):
            shape = torch.zeros(s.shape).sum(_dims(dims), keepdim=keepdim).shape
            dtype = torch.int64 if name.startswith("arg") else s.dtype
            return torch.full(shape, EMPTY_POLICY[name], dtype=dtype)
        return torch_fn(s, dims, keepdim)

    return ref


def _var(s: torch.Tensor, dims: Any, keepdim: bool, correction: int, root: bool) -> torch.Tensor:
    """torch's var/std evaluated in float64 and rounded to the sample's dtype: raggedfn
    accumulates them in float64 as torch's CPU forward does; torch's float32 backward
    rounds in float32 and, where its terms cancel, misses by more than float32 tolerance."""
    with warnings.catch_warnings():  # torch warns where count - correction <= 0 (NaN result)
        warnings.simplefilter("ignore", UserWarning)
        fn = torch.std if root else torch.var
        return fn(s.double(), dims, correction=correction, keepdim=keepdim).to(s.dtype)


# name -> (raggedfn op(x, dims, keepdim), reference(sample, sample dims, keepdim), tuple dims ok)
OPS: dict[str, tuple[Callable[..., Any], Callable[..., torch.Tensor], bool]] = {
    "sum": (raggedfn.sum, lambda s, d, k: torch.sum(s, d, keepdim=k), True),
    "mean": (raggedfn.mean, lambda s, d, k: torch.mean(s, d, keepdim=k), True),
    "amax": (raggedfn.amax, _policy("amax", lambda s, d, k: torch.amax(s, d, keepdim=k)), True),
    "amin": (raggedfn.amin, _policy("amin", lambda s, d, k: torch.amin(s, d, keepdim=k)), True),
    "logsumexp": (raggedfn.logsumexp, lambda s, d, k: torch.logsumexp(s, d, keepdim=k), True),
    "prod": (raggedfn.prod, lambda s, d, k: torch.prod(s, d, keepdim=k), False),
    "var": (
        lambda x, d, k: raggedfn.var(x, d, keepdim=k),
        lambda s, d, k: _var(s, d, k, 1, False),
        True,
    ),
    "var0": (
        lambda x, d, k: raggedfn.var(x, d, keepdim=k, correction=0),
        lambda s, d, k: _var(s, d, k, 0, False),
        True,
    ),
    "std": (
        lambda x, d, k: raggedfn.std(x, d, keepdim=k),
        lambda s, d, k: _var(s, d, k, 1, True),
        True,
    ),
    "norm2": (
        lambda x, d, k: raggedfn.norm(x, 2, d, k),
        lambda s, d, k: torch.linalg.vector_norm(s, 2, d, k),
        True,
    ),
    "norm1": (
        lambda x, d, k: raggedfn.norm(x, 1, d, k),
        lambda s, d, k: torch.linalg.vector_norm(s, 1, d, k),
        True,
    ),
    "norm3": (
        lambda x, d, k: raggedfn.norm(x, 3, d, k),
        lambda s, d, k: torch.linalg.vector_norm(s, 3, d, k),
        True,
    ),
    "norm0": (
        lambda x, d, k: raggedfn.norm(x, 0, d, k),
        lambda s, d, k: torch.linalg.vector_norm(s, 0, d, k),
        True,
    ),
    "norm_inf": (
        lambda x, d, k: raggedfn.norm(x, math.inf, d, k),
        _policy("norm_inf", lambda s, d, k: torch.linalg.vector_norm(s, math.inf, d, k)),
        True,
    ),
    "norm_-inf": (
        lambda x, d, k: raggedfn.norm(x, -math.inf, d, k),
        _policy("norm_-inf", lambda s, d, k: torch.linalg.vector_norm(s, -math.inf, d, k)),
        True,
    ),
}


@st.composite
def reduced_dims(draw: Any, x: raggedfn.Ragged, tuples: bool) -> int | tuple[int, ...]:
    """One sample axis (maybe negative) or, if allowed, a tuple of several."""
    rank = x.layout.rank
    if tuples and rank >= 2 and draw(st.booleans()):
        chosen = draw(st.lists(st.integers(1, rank), min_size=2, max_size=rank, unique=True))
        return tuple(a - x.ndim if draw(st.booleans()) else a for a in chosen)
    axis = draw(st.integers(1, rank))
    return axis - x.ndim if draw(st.booleans()) else axis


def _sample_dims(x: raggedfn.Ragged, dims: int | tuple[int, ...]) -> int | tuple[int, ...]:
    if isinstance(dims, int):
        return dims % x.ndim - 1
    return tuple(d % x.ndim - 1 for d in dims)


def _cotangents(expected: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(e.shape, generator=gen, dtype=torch.float64).to(e.dtype) for e in expected]


def _loss(outputs: list[torch.Tensor], cotangents: list[torch.Tensor]) -> torch.Tensor:
    """Sum of output * cotangent over finite outputs (non-finite ones are policy values)."""
    total = torch.zeros((), dtype=torch.float64)
    for out, cot in zip(outputs, cotangents, strict=True):
        finite = torch.isfinite(out.detach())
        total = total + torch.where(finite, out * cot, torch.zeros_like(out)).sum().double()
    return total


def _grads(loss: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    if not loss.requires_grad:
        return [torch.zeros_like(t) for t in inputs]
    return list(torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True))


def check_against_loop(op: Callable[..., Any], ref: Callable[..., torch.Tensor],
                       x: raggedfn.Ragged, dims: Any, keepdim: bool, seed: int,
                       undefined_grad_is_zero: bool = False) -> None:  # fmt: skip
    version = x.values._version
    result = op(x, dims, keepdim)
    assert x.values._version == version, "the op modified its input"
    per_sample = samples(x)
    expected = [ref(s, _sample_dims(x, dims), keepdim) for s in per_sample]
    assert_same(result, [e.detach() for e in expected])
    if not x.values.requires_grad:
        return
    outputs = samples(result) if isinstance(result, raggedfn.Ragged) else list(result.unbind(0))
    cotangents = _cotangents(expected, seed)
    got = _grads(_loss(outputs, cotangents), [x.values])[0]
    want = pack_like(_grads(_loss(expected, cotangents), per_sample), x)
    if undefined_grad_is_zero:
        # Policy (var/std): where count - correction <= 0 the result is NaN/inf as in
        # torch, but its gradient is 0 where torch's is NaN.
        want = torch.nan_to_num(want, nan=0.0)
    assert torch.isfinite(got).all(), "non-finite gradient"
    torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("name", sorted(OPS))
@SETTINGS
@given(data=st.data())
def test_reduction_matches_loop(name: str, data: st.DataObject) -> None:
    op, ref, tuples = OPS[name]
    x = data.draw(raggeds(dtype=FLOATS, requires_grad=True))
    dims = data.draw(reduced_dims(x, tuples))
    keepdim = data.draw(st.booleans())
    seed = data.draw(st.integers(0, 2**16))
    check_against_loop(op, ref, x, dims, keepdim, seed, name in ("var", "var0", "std"))


@pytest.mark.parametrize("name", ["argmax", "argmin"])
@SETTINGS
@given(data=st.data())
def test_arg_reduction_matches_loop(name: str, data: st.DataObject) -> None:
    op = getattr(raggedfn, name)
    torch_fn = getattr(torch, name)
    ref = _policy(name, lambda s, d, k: torch_fn(s, d, keepdim=k))
    # Integer-valued floats: ties are common, and the first index must win.
    x = data.draw(raggeds(dtype=FLOATS))
    x = x.with_values(torch.round(x.values * 2))
    dims = data.draw(reduced_dims(x, False))
    check_against_loop(op, ref, x, dims, data.draw(st.booleans()), 0)


@pytest.mark.parametrize("name", ["amax", "amin"])
@SETTINGS
@given(data=st.data())
def test_extremum_ties_share_gradient_like_torch(name: str, data: st.DataObject) -> None:
    op, ref, _ = OPS[name]
    x = data.draw(raggeds(dtype=FLOATS, requires_grad=True))
    rounded = torch.round(x.values.detach() * 2).requires_grad_(True)
    x = x.with_values(rounded)
    dims = data.draw(reduced_dims(x, True))
    check_against_loop(op, ref, x, dims, data.draw(st.booleans()), 1)


@pytest.mark.parametrize("name", ["all", "any"])
@SETTINGS
@given(data=st.data())
def test_logical_reduction_matches_loop(name: str, data: st.DataObject) -> None:
    op = getattr(raggedfn, name)
    torch_fn = getattr(torch, name)
    x = data.draw(raggeds(dtype=st.sampled_from([torch.bool, torch.int64, torch.float32])))
    dims = data.draw(reduced_dims(x, True))
    check_against_loop(op, lambda s, d, k: torch_fn(s, d, keepdim=k), x, dims,
                       data.draw(st.booleans()), 0)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
@SETTINGS
@given(data=st.data())
def test_integer_sum_and_extrema_match_loop(dtype: torch.dtype, data: st.DataObject) -> None:
    x = data.draw(raggeds(dtype=dtype))
    dims = data.draw(reduced_dims(x, True))
    keepdim = data.draw(st.booleans())
    check_against_loop(raggedfn.sum, OPS["sum"][1], x, dims, keepdim, 0)
    if dtype != torch.bool:
        info = torch.iinfo(dtype)
        for name, fill in (("amax", info.min), ("amin", info.max)):
            torch_fn = getattr(torch, name)

            def ref(s: torch.Tensor, d: Any, k: bool, torch_fn: Any = torch_fn,
                    fill: int = fill) -> torch.Tensor:  # fmt: skip
                if any(s.shape[a] == 0 for a in _dims(d)):
                    shape = torch.zeros(s.shape).sum(_dims(d), keepdim=k).shape
                    return torch.full(shape, fill, dtype=s.dtype)
                return torch_fn(s, d, keepdim=k)

            check_against_loop(getattr(raggedfn, name), ref, x, dims, keepdim, 0)


FULL = ["sum", "mean", "amax", "amin", "logsumexp", "prod", "var", "std", "norm2"]


@pytest.mark.parametrize("name", FULL)
@SETTINGS
@given(data=st.data())
def test_full_reduction_matches_flat_loop(name: str, data: st.DataObject) -> None:
    op, ref, _ = OPS[name]
    x = data.draw(raggeds(dtype=FLOATS, requires_grad=True))
    keepdim = data.draw(st.booleans())
    every = data.draw(st.sampled_from([None, tuple(range(x.ndim)), ()]))
    result = op(x, every, keepdim)
    per_sample = samples(x)
    flat = torch.cat([s.reshape(-1) for s in per_sample] + [x.values.new_zeros(0)])
    want = ref(flat, 0, False)
    if keepdim:
        want = want.reshape((1,) * x.ndim)
    assert result.shape == want.shape
    torch.testing.assert_close(result, want.detach(), equal_nan=True)
    if torch.isfinite(want).all() and want.requires_grad:
        got = torch.autograd.grad(result.sum(), x.values)[0]
        expected = torch.autograd.grad(want.sum(), per_sample, materialize_grads=True,
                                       allow_unused=True)  # fmt: skip
        torch.testing.assert_close(got, pack_like(expected, x), equal_nan=True)
