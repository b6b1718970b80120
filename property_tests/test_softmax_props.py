"""softmax, log_softmax and cumsum equal the per-sample loop, in values and gradients.

These ops keep the shape of a sample, so torch's op on every sample is the
reference everywhere, empty samples included (they stay empty).
"""

from __future__ import annotations

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
SETTINGS = settings(deadline=None, max_examples=50)

OPS: dict[str, tuple[Callable[..., Any], Callable[..., torch.Tensor]]] = {
    "softmax": (raggedfn.softmax, torch.softmax),
    "log_softmax": (raggedfn.log_softmax, torch.log_softmax),
    "cumsum": (raggedfn.cumsum, torch.cumsum),
}


def _axis(draw: Any, x: raggedfn.Ragged) -> int:
    axis = draw(st.integers(1, x.layout.rank))
    return axis - x.ndim if draw(st.booleans()) else axis


def _check(name: str, x: raggedfn.Ragged, dim: int, seed: int) -> None:
    op, torch_op = OPS[name]
    version = x.values._version
    result = op(x, dim)
    assert x.values._version == version, "the op modified its input"
    assert isinstance(result, raggedfn.Ragged)
    assert result.offsets is x.offsets and result.layout == x.layout
    per_sample = samples(x)
    expected = [torch_op(s, dim % x.ndim - 1) for s in per_sample]
    assert_same(result, [e.detach() for e in expected])
    if not x.values.requires_grad:
        return
    gen = torch.Generator().manual_seed(seed)
    cotangent = torch.randn(result.values.shape, generator=gen, dtype=torch.float64)
    cotangent = cotangent.to(x.dtype)
    got = torch.autograd.grad((result.values * cotangent).sum(), x.values, allow_unused=True,
                              materialize_grads=True)[0]  # fmt: skip
    # The same cotangent, cut per sample like the result.
    cut = samples(result.with_values(cotangent))
    loss = sum(((e * c).sum() for e, c in zip(expected, cut, strict=True)), torch.zeros(()))
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        want = torch.autograd.grad(loss, per_sample, allow_unused=True, materialize_grads=True)
        want_packed = pack_like(want, x)
    else:
        want_packed = torch.zeros_like(x.values)
    assert torch.isfinite(got).all(), "non-finite gradient"
    torch.testing.assert_close(got, want_packed)


@pytest.mark.parametrize("name", sorted(OPS))
@SETTINGS
@given(data=st.data())
def test_matches_loop(name: str, data: st.DataObject) -> None:
    x = data.draw(raggeds(dtype=FLOATS, requires_grad=True))
    _check(name, x, _axis(data.draw, x), data.draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("num_ragged", [1, 2])
@SETTINGS
@given(data=st.data())
def test_ragged_axis_of_r1_and_r2(num_ragged: int, data: st.DataObject) -> None:
    """Every ragged axis explicitly (the generic test may draw a dense one)."""
    x = data.draw(raggeds(num_ragged=num_ragged, dtype=FLOATS, requires_grad=True))
    ragged = data.draw(st.sampled_from(x.ragged_dims))
    for name in sorted(OPS):
        _check(name, x, ragged, data.draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
@SETTINGS
@given(data=st.data())
def test_integer_cumsum_matches_loop(dtype: torch.dtype, data: st.DataObject) -> None:
    x = data.draw(raggeds(dtype=dtype))
    _check("cumsum", x, _axis(data.draw, x), 0)
