"""softmax along the one ragged axis of a large CPU value runs torch's fused kernel once
per sample (``_prims/_softmax.py``, ``PER_SEGMENT_MIN``): the per-sample loop's own kernel,
so the results equal the loop's bit for bit, in values and first-order gradients; second
order (a backward that records a graph), torch.func transforms and compile take the
segment form. Each test forces the path (or its absence) and checks that it ran."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import raggedfn
from raggedfn import _index
from raggedfn._prims import _softmax

INF, NAN = float("inf"), float("nan")


def _spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"forward": 0, "backward": 0}
    forward, backward = torch._softmax, torch._softmax_backward_data

    def spy_forward(*args: Any, **kwargs: Any) -> Any:
        calls["forward"] += 1
        return forward(*args, **kwargs)

    def spy_backward(*args: Any, **kwargs: Any) -> Any:
        calls["backward"] += 1
        return backward(*args, **kwargs)

    monkeypatch.setattr(torch, "_softmax", spy_forward)
    monkeypatch.setattr(torch, "_softmax_backward_data", spy_backward)
    return calls


def _value(lengths, dtype=torch.float32, extremes=False, *rest):
    gen = torch.Generator().manual_seed(len(lengths))
    parts = [torch.randn(n, *(rest or (5,)), generator=gen, dtype=dtype) * 3 for n in lengths]
    if extremes:
        parts[0][0, 0] = INF
        parts[0][:, 1] = -INF
        parts[-1][1, 2] = NAN
        parts[-1][:, 3] *= 1e3
    return raggedfn.from_list(parts)


def _loop(x: raggedfn.Ragged) -> list[torch.Tensor]:
    return [torch.softmax(s, 0) for s in raggedfn.unbind(x)]


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(_softmax, "PER_SEGMENT_MIN", 1)
    return _spy(monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lengths", [(3, 0, 4, 2), (1,), (0, 0, 5), (6, 2, 0)])
def test_per_sample_kernels_equal_the_loop_bit_for_bit(forced, lengths, dtype):
    x = _value(lengths, dtype, extremes=lengths[0] > 1 and lengths[-1] > 1)
    values = x.values.detach().requires_grad_()
    out = raggedfn.softmax(x.with_values(values), 1)
    assert forced["forward"] == sum(n > 0 for n in lengths)
    loop_values = [s.detach().clone().requires_grad_() for s in raggedfn.unbind(x)]
    want = [torch.softmax(s, 0) for s in loop_values]
    for got, expected in zip(raggedfn.unbind(out), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    weights = torch.randn(out.values.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad(out.values, values, weights)
    assert forced["backward"] == sum(n > 0 for n in lengths)
    parts = weights.split(list(lengths))
    expected = torch.autograd.grad(want, loop_values, list(parts), allow_unused=True)
    expected = torch.cat(
        [
            e if e is not None else torch.zeros_like(v)
            for e, v in zip(expected, loop_values, strict=True)
        ]
    )
    torch.testing.assert_close(grad, expected, rtol=0, atol=0, equal_nan=True)


def test_features_of_several_axes_and_non_contiguous_values(forced):
    x = _value((4, 0, 3), torch.float64, False, 2, 3)
    strided = x.with_values(x.values.transpose(1, 2).contiguous().transpose(1, 2))
    assert not strided.values.is_contiguous()
    out = raggedfn.softmax(strided, 1)
    assert forced["forward"] == 2
    for got, expected in zip(raggedfn.unbind(out), _loop(x), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_gradcheck_and_gradgradcheck_through_the_per_sample_backward(forced):
    x = _value((3, 0, 2), torch.float64)
    values = x.values.detach().requires_grad_()

    def fn(v):
        return raggedfn.softmax(x.with_values(v), 1).values

    assert torch.autograd.gradcheck(fn, (values,))
    assert forced["backward"] > 0  # first order: per sample
    assert torch.autograd.gradgradcheck(fn, (values,))
    # a backward that records a graph takes the segment form (differentiable again) and
    # its double backward equals the loop's
    seen = forced["backward"]
    weights = torch.randn(values.shape, dtype=torch.float64)
    (first,) = torch.autograd.grad(fn(values), values, weights, create_graph=True)
    assert forced["backward"] == seen and first.requires_grad
    (second,) = torch.autograd.grad((first * first).sum(), values)
    loop_values = values.detach().clone().requires_grad_()
    want = torch.cat([torch.softmax(p, 0) for p in loop_values.split([3, 0, 2])])
    (first_loop,) = torch.autograd.grad(want, loop_values, weights, create_graph=True)
    (second_loop,) = torch.autograd.grad((first_loop * first_loop).sum(), loop_values)
    torch.testing.assert_close(first, first_loop)
    torch.testing.assert_close(second, second_loop)


def test_torch_func_transforms_take_the_segment_form(forced):
    x = _value((3, 0, 4), torch.float64)
    weights = torch.randn(x.values.shape, dtype=torch.float64)

    def loss(v):
        return (raggedfn.softmax(x.with_values(v), 1).values * weights).sum()

    def loop_loss(v):
        parts = v.split([3, 0, 4])
        return (torch.cat([torch.softmax(p, 0) for p in parts]) * weights).sum()

    for transform in (torch.func.grad, torch.func.jacrev):
        torch.testing.assert_close(transform(loss)(x.values), transform(loop_loss)(x.values))
    tangent = torch.randn_like(x.values)
    got = torch.func.jvp(loss, (x.values,), (tangent,))
    want = torch.func.jvp(loop_loss, (x.values,), (tangent,))
    torch.testing.assert_close(got, want)
    batched = torch.func.vmap(lambda v: raggedfn.softmax(x.with_values(v), 1).values)
    stacked = torch.stack([x.values, 2 * x.values])
    torch.testing.assert_close(
        batched(stacked),
        torch.stack([raggedfn.softmax(x.with_values(v), 1).values for v in stacked]),
    )


def test_default_threshold_keeps_small_values_on_the_segment_form(monkeypatch):
    calls = _spy(monkeypatch)
    small = _value((3, 4, 2))  # 45 elements over 3 samples
    raggedfn.softmax(small, 1)
    assert calls["forward"] == 0
    large = _value((900, 0, 1000), torch.float32, False, 8)  # 7600 elements per sample
    out = raggedfn.softmax(large, 1)
    assert calls["forward"] == 2
    for got, expected in zip(raggedfn.unbind(out), _loop(large), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_sample_bounds_are_read_on_the_host_once_per_partition(forced, monkeypatch):
    reads: list[tuple[int, ...]] = []
    tolist = torch.Tensor.tolist

    def spy(self: torch.Tensor) -> Any:
        reads.append(tuple(self.shape))
        return tolist(self)

    x = _value((5, 0, 3, 4), torch.float64)
    other = _value((2, 6), torch.float64)
    monkeypatch.setattr(torch.Tensor, "tolist", spy)
    for step in range(3):  # forward and backward of three calls on one partition
        values = (x.values * (step + 1)).requires_grad_()
        out = raggedfn.softmax(x.with_values(values), 1)
        (grad,) = torch.autograd.grad(out.values, values, torch.ones_like(values) + values)
        monkeypatch.setattr(torch.Tensor, "tolist", tolist)
        loop_values = values.detach().clone().requires_grad_()
        want = torch.cat([torch.softmax(p, 0) for p in loop_values.split([5, 0, 3, 4])])
        (expected,) = torch.autograd.grad(want, loop_values, torch.ones_like(values) + values)
        monkeypatch.setattr(torch.Tensor, "tolist", spy)
        torch.testing.assert_close(out.values, want, rtol=0, atol=0)
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)
    assert forced["forward"] == forced["backward"] == 3 * 3  # per sample, every call
    assert reads == [(5,)]
    out = raggedfn.softmax(other, 1)  # another partition: its own read
    assert reads == [(5,), (3,)]
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    for got, expected in zip(raggedfn.unbind(out), _loop(other), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_host_bounds_are_forgotten_with_their_partition(forced):
    x = _value((3, 2))
    raggedfn.softmax(x, 1)
    _, bounds = _index.segment_bounds(x.offsets, x.values.shape[0])
    key = id(bounds)
    assert _index._HOST_LISTS[key][2] == [0, 3, 5]
    del x, bounds
    gc.collect()
    assert key not in _index._HOST_LISTS


def test_bounds_modified_in_place_are_read_again():
    bounds = torch.tensor([0, 2, 5])
    assert _index.host_bounds(bounds) == [0, 2, 5]
    bounds[1] = 3
    assert _index.host_bounds(bounds) == [0, 3, 5]
