"""Segment-primitive behaviour that ``make mutate`` (the prims slice) found untested.

Each test compares a primitive with torch on each sample alone (or checks which kernel
calls it makes); each was seen failing with the surviving mutant applied.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import raggedfn
from raggedfn import _prims
from raggedfn._prims import _varlen
from tests.test_varlen_prim import assert_same_grads


def test_logsumexp_shifts_by_the_largest_finite_entry():
    # kills _softmax.x__shift__mutmut_39 (largest=False: the shift is the segment's
    # minimum, so exp(x - shift) overflows to inf where the entries span more than
    # float32's exp range, here 120 > 88.7); also caught by tests/test_softmax_extremes.py
    values = torch.tensor(
        [[-60.0, 1.0], [60.0, 2.0], [0.5, -80.0], [3.0, 30.0], [-1.0, 0.0]],
        dtype=torch.float32,
    )
    segments = torch.tensor([0, 0, 2, 2, 0])  # unsorted, segment 1 empty
    num = 3
    got = _prims.segment_logsumexp(values, segments, num)
    for s in range(num):
        rows = values[segments == s]
        torch.testing.assert_close(got[s], torch.logsumexp(rows, 0))
    # with the trailing axis reduced too (dims): one shift over everything reduced
    got = _prims.segment_logsumexp(values, segments, num, dims=(1,))
    for s in range(num):
        rows = values[segments == s]
        torch.testing.assert_close(got[s], torch.logsumexp(rows, (0, 1)).reshape(1))


def packed(lengths, seed, dtype=torch.float64, heads=2, dim=3):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(lengths), heads, dim, generator=gen, dtype=dtype)
    return raggedfn.from_lengths(values.requires_grad_(True), torch.tensor(lengths))


@pytest.mark.parametrize(
    ("q_lengths", "k_lengths"), [([3, 3], [0, 0]), ([0, 0], [2, 2])], ids=["no-keys", "no-queries"]
)
def test_varlen_equal_lengths_with_an_empty_axis_skip_the_kernel(monkeypatch, q_lengths, k_lengths):
    # kills _varlen.x__uniform__mutmut_9 (`(n and m) or True`: equal lengths with no keys
    # or no queries take the batched kernel call, whose CPU kernel dies of SIGFPE on an
    # empty axis; mutmut saw only the crash, "suspicious"). The kernels are wrapped so
    # that such a call fails the test instead of killing the process.
    def guarded(kernel):
        def run(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            empty = [tuple(t.shape) for t in tensors if t.numel() == 0]
            assert not empty, f"the fused kernel got an empty input: {empty}"
            return kernel(*args, **kwargs)

        return run

    monkeypatch.setattr(_varlen, "_KERNEL", guarded(_varlen._KERNEL))
    monkeypatch.setattr(_varlen, "_KERNEL_BACKWARD", guarded(_varlen._KERNEL_BACKWARD))
    q, k, v = packed(q_lengths, 0), packed(k_lengths, 1), packed(k_lengths, 2)
    got = _prims.varlen_attention(q.values, k.values, v.values, q.offsets, k.offsets, v.offsets)
    # torch's SDPA per sample: zeros for a query without keys, nothing without queries
    outs = []
    for qs, ks, vs in zip(raggedfn.unbind(q), raggedfn.unbind(k), raggedfn.unbind(v), strict=True):
        if ks.shape[0] == 0:
            outs.append(qs * 0)
        else:
            heads = [t.transpose(0, 1) for t in (qs, ks, vs)]
            outs.append(F.scaled_dot_product_attention(*heads).transpose(0, 1))
    want = torch.cat(outs)
    torch.testing.assert_close(got, want)
    assert_same_grads(got, want, [q.values, k.values, v.values], torch.ones_like(got))
