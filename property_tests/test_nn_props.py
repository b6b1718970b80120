"""linear, layer_norm and rms_norm equal the per-sample loop, in values and gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests._elementwise_helpers import check
from property_tests.reference import samples
from property_tests.strategies import raggeds

SETTINGS = settings(deadline=None, max_examples=40)
FLOATS = st.sampled_from([torch.float64, torch.float32])
# dense axes last logically; ragged axes and the other dense axes in any storage order
FEATURES = st.sampled_from([(3,), (2, 3), (2, 1, 3)])


@st.composite
def trailing_dense(draw, count, dtype):
    """A Ragged whose last ``count`` logical axes are dense (any storage order)."""
    x = draw(raggeds(dtype=dtype, requires_grad=True, feature_shape=FEATURES))
    axes = x.layout.axes
    if any(a.ragged for a in axes[len(axes) - count :]):
        # move the ragged axes to the front, keeping the drawn storage numbering
        order = sorted(range(len(axes)), key=lambda p: not axes[p].ragged)
        x = raggedfn.permute(x, (0, *(1 + p for p in order)))
        x = x.with_values(x.values.detach().requires_grad_(True))
    return x


def _param(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)


@SETTINGS
@given(data=st.data(), dtype=FLOATS, with_bias=st.booleans())
def test_linear(data, dtype, with_bias) -> None:
    x = data.draw(trailing_dense(1, dtype))
    d_in = x.shape[-1]
    d_out = data.draw(st.integers(1, 4))
    weight = _param((d_out, d_in), dtype, 0)
    bias = _param((d_out,), dtype, 1) if with_bias else None
    out = check(raggedfn.linear, F.linear, x, weight, bias)
    assert out.shape == (*x.shape[:-1], d_out)


@SETTINGS
@given(data=st.data(), dtype=FLOATS, affine=st.booleans())
def test_layer_norm(data, dtype, affine) -> None:
    count = data.draw(st.integers(1, 2))
    x = data.draw(trailing_dense(count, dtype))
    count = min(count, x.layout.num_dense)
    shape = tuple(x.shape[x.ndim - count :])
    weight = _param(shape, dtype, 2) if affine else None
    bias = _param(shape, dtype, 3) if affine else None
    check(
        lambda v, w, b: raggedfn.layer_norm(v, shape, w, b, eps=1e-3),
        lambda s, w, b: F.layer_norm(s, shape, w, b, eps=1e-3),
        x,
        weight,
        bias,
    )


@SETTINGS
@given(data=st.data(), dtype=FLOATS, affine=st.booleans())
def test_rms_norm(data, dtype, affine) -> None:
    count = data.draw(st.integers(1, 2))
    x = data.draw(trailing_dense(count, dtype))
    count = min(count, x.layout.num_dense)
    shape = tuple(x.shape[x.ndim - count :])
    weight = _param(shape, dtype, 4) if affine else None
    check(
        lambda v, w: raggedfn.rms_norm(v, shape, w, eps=1e-3),
        lambda s, w: F.rms_norm(s, shape, w, eps=1e-3),
        x,
        weight,
    )


@settings(deadline=None, max_examples=15)
@given(x=raggeds(dtype=torch.float64, feature_shape=(3,), dim_order="ragged_first"))
def test_per_example_gradients_of_a_linear_layer(x) -> None:
    """vmap(grad) over an extra leading axis of values: one weight gradient per copy."""
    weight = torch.randn(2, 3, dtype=torch.float64)
    stack = torch.stack([x.values, x.values * 2, x.values - 1])

    def loss(w, values):
        y = raggedfn.layer_norm(raggedfn.linear(x.with_values(values), w), 2, eps=1e-3)
        return (y.values**2).sum() + y.values.sum()

    got = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(weight, stack)
    for e, values in enumerate(stack):
        w = weight.clone().requires_grad_(True)
        total = torch.zeros((), dtype=torch.float64)
        for s in samples(x.with_values(values)):
            y = F.layer_norm(F.linear(s, w), (2,), eps=1e-3)
            total = total + (y**2).sum() + y.sum()
        expected = torch.autograd.grad(total, w)[0] if total.requires_grad else torch.zeros_like(w)
        torch.testing.assert_close(got[e], expected)
