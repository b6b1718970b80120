"""raggedfn.map's batched matrix products with batch (head) axes: ``q @ k^T`` making a
pair state, ``p @ v`` contracting one, and DeBERTa's ``q @ pos_key^T`` against a
shared or a per-sample (dense-batched) ``pos_key``, all through ``raggedfn.einsum``
(length buckets, or one product of the packed rows), never the packed ``(m, k, n)``
enumeration, which products of unequal batch axes take. Values and gradients against the
per-sample loop, float64."""

from __future__ import annotations

import pytest
import torch

import raggedfn
from property_tests.reference import assert_same
from raggedfn._map.rules import _linalg
from raggedfn.ops import _products

H, D, SPAN = 3, 4, 6
LENGTHS = (3, 0, 5, 1, 7, 2)


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = raggedfn.from_list(
        [torch.randn(n, H * D, generator=gen, dtype=torch.float64) for n in LENGTHS]
    )
    shared = torch.randn(H, SPAN, D, generator=gen, dtype=torch.float64)
    per_sample = torch.randn(len(LENGTHS), H, SPAN, D, generator=gen, dtype=torch.float64)
    return x, shared, per_sample


def attention(x, pos):
    """Eager attention over heads with a content -> position term (DeBERTa's c2p)."""
    n = x.shape[0]
    q = x.view(n, H, D).transpose(0, 1)  # [H, n, D]
    k = (2 * x).view(n, H, D).transpose(0, 1)
    scores = torch.bmm(q, k.transpose(-1, -2))  # [H, n, n]: a pair state
    c2p = torch.bmm(q, pos.transpose(-1, -2))  # [H, n, SPAN]: rows against pos
    scores = scores + c2p.sum(-1, keepdim=True)
    p = torch.softmax(scores, -1)
    return torch.bmm(p, k).transpose(0, 1).reshape(n, H * D)  # contracts the pairs


def _loss(rows):
    return (rows * torch.linspace(-1, 1, rows.numel(), dtype=rows.dtype).view_as(rows)).sum()


@pytest.mark.parametrize("pos_kind", ["shared", "per_sample"])
def test_head_products_take_einsum_and_equal_the_loop(pos_kind, monkeypatch):
    x, shared, per_sample = _inputs()
    pos = shared if pos_kind == "shared" else per_sample
    in_dims = (0, None if pos_kind == "shared" else 0)
    calls = []
    real = _products.einsum
    monkeypatch.setattr(_products, "einsum", lambda *a: calls.append(a[0]) or real(*a))

    values = x.values.detach().requires_grad_()
    pos_leaf = pos.detach().requires_grad_()
    xr = raggedfn.from_lengths(values, x.lengths)
    report = raggedfn.map_report(attention, xr, pos_leaf, in_dims=in_dims)
    assert report.fully_batched, report
    got = report.output
    # q @ k^T, q @ pos^T, p @ k in each of the two passes (report and output)
    pos_eq = "zAik,Akj->zAij" if pos_kind == "shared" else "zAik,zAkj->zAij"
    assert calls.count("zAik,zAkj->zAij") >= 2 and pos_eq in calls, calls

    ref_values = values.detach().clone().requires_grad_()
    ref_pos = pos.detach().clone().requires_grad_()
    parts = ref_values.split(x.lengths.tolist())
    want = [
        attention(s, ref_pos if pos_kind == "shared" else ref_pos[i]) for i, s in enumerate(parts)
    ]
    assert_same(got, want)
    grads = torch.autograd.grad(_loss(got.values), [values, pos_leaf])
    want_grads = torch.autograd.grad(_loss(torch.cat(want)), [ref_values, ref_pos])
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize(
    "f",
    [
        lambda t: (t @ t.T) @ t[None],  # (n, n) @ (1, n, D): m and k ragged
        lambda t: torch.softmax(t @ t.T, -1)[None] @ t,  # (1, n, n) @ (n, D)
        lambda t: t.T[None] @ (t @ t.T),  # (1, D, n) @ (n, n): k and n ragged
    ],
    ids=["m-k", "softmax-m-k", "k-n"],
)
def test_products_over_a_ragged_inner_axis_with_other_batch_axes_are_batched(f, monkeypatch):
    """Operands of unequal batch axes (one has a leading 1) take the packed ``(m, k, n)``
    enumeration, which sums over the ragged ``k`` into the rows of the ragged ``m`` or
    ``n`` of the result."""
    x, _, _ = _inputs()
    sums = []
    real = _linalg.segment
    monkeypatch.setattr(_linalg, "segment", lambda *a: sums.append(a[-1]) or real(*a))
    report = raggedfn.map_report(f, x)
    assert report.fully_batched, str(report)
    assert sums == ["sum"], sums  # the enumeration's sum over k, once
    assert_same(report.output, [f(s) for s in raggedfn.unbind(x)])
