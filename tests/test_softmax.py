"""``raggedfn.softmax``/``log_softmax`` (ops/_softmax.py): each path forced, against the
per-sample loop of torch's softmax, in values and gradients."""

from __future__ import annotations

import pytest
import torch

import raggedfn
from raggedfn._prims import _softmax

LENGTHS = [3, 0, 5, 1, 0, 4]


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    original = torch.segment_reduce

    def spy(*args, **kwargs):
        calls.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "segment_reduce", spy)
    return calls


@pytest.mark.parametrize("path", ["segment_reduce", "general"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softmax_along_the_ragged_axis_equals_the_loop(path, dtype, monkeypatch):
    monkeypatch.setattr(_softmax, "SEGMENT_REDUCE_MAX", 10**9 if path == "segment_reduce" else 0)
    calls = _spy(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    values = (10 * torch.randn(sum(LENGTHS), 3, generator=gen)).to(dtype).requires_grad_(True)
    x = raggedfn.from_lengths(values, LENGTHS)
    out = raggedfn.softmax(x, 1)
    assert calls == (["max", "sum"] if path == "segment_reduce" else [])
    want = torch.cat([part.softmax(0) for part in values.split(LENGTHS)])
    torch.testing.assert_close(out.values, want)
    assert out.offsets is x.offsets and out.sizes is x.sizes
    cotangent = torch.randn(want.shape, generator=gen).to(dtype)
    torch.testing.assert_close(
        torch.autograd.grad(out.values, values, cotangent)[0],
        torch.autograd.grad(want, values, cotangent)[0],
    )


def test_softmax_of_half_values_takes_the_general_path(monkeypatch):
    monkeypatch.setattr(_softmax, "SEGMENT_REDUCE_MAX", 10**9)
    calls = _spy(monkeypatch)
    x = raggedfn.from_lengths(torch.randn(sum(LENGTHS), 3).to(torch.float16), LENGTHS)
    out = raggedfn.softmax(x, 1)
    assert calls == []
    want = torch.cat([part.float().softmax(0) for part in x.values.split(LENGTHS)])
    torch.testing.assert_close(out.values.float(), want, atol=2e-3, rtol=2e-3)


def test_softmax_is_general_above_the_size_limit(monkeypatch):
    calls = _spy(monkeypatch)
    values = torch.randn(sum(LENGTHS), 3)
    monkeypatch.setattr(_softmax, "SEGMENT_REDUCE_MAX", values.numel() - 1)
    raggedfn.softmax(raggedfn.from_lengths(values, LENGTHS), 1)
    assert calls == []
    monkeypatch.setattr(_softmax, "SEGMENT_REDUCE_MAX", values.numel())
    raggedfn.softmax(raggedfn.from_lengths(values, LENGTHS), 1)
    assert calls == ["max", "sum"]


def test_softmax_of_two_ragged_axes_and_of_a_dense_axis_equal_the_loop():
    pairs = [torch.randn(n, n) for n in (2, 0, 3)]
    x = raggedfn.from_list(pairs, ragged_dims=(1, 2))
    for dim in (1, 2, -1):
        got = raggedfn.unbind(raggedfn.softmax(x, dim))
        for a, b in zip(got, pairs, strict=True):
            torch.testing.assert_close(a, b.softmax(dim - 1 if dim > 0 else dim))
    tokens = [torch.randn(n, 4) for n in (2, 0, 3)]
    y = raggedfn.softmax(raggedfn.from_list(tokens), 2)
    for a, b in zip(raggedfn.unbind(y), tokens, strict=True):
        torch.testing.assert_close(a, b.softmax(1))
