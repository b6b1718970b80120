"""Ops behaviour that ``make mutate`` found untested (docs/testing.md, ops survivors).

Each test compares with torch run on every sample alone (or the error it must raise)
and was seen failing with the surviving mutant applied by hand.
"""

from __future__ import annotations

import pytest
import torch

import raggedfn
from raggedfn import RaggedError


def _samples(x: raggedfn.Ragged) -> list[torch.Tensor]:
    return list(raggedfn.unbind(x))


def test_broadcasting_two_values_ragged_along_different_axes_builds_the_outer_partition() -> None:
    # x: (B, N*, 1, D), y: (B, 1, M*, D): the result (B, N*, M*, D) has a partition
    # that neither operand holds, built from x's N and y's M (the owners of each axis)
    gen = torch.Generator().manual_seed(0)
    ns, ms = [2, 0, 3, 1], [3, 2, 1, 4]
    xs = [torch.randn(n, 1, 2, generator=gen) for n in ns]
    ys = [torch.randn(1, m, 2, generator=gen) for m in ms]
    x = raggedfn.from_list(xs, ragged_dims=(1,))
    y = raggedfn.from_list(ys, ragged_dims=(2,))
    for out in (x + y, y * x, raggedfn.where(x > 0, x, y)):
        assert out.shape[1:] == x.shape[1:2] + y.shape[2:]
        assert out.sizes.tolist() == [[n, m] for n, m in zip(ns, ms, strict=True)]
    wants = [
        [a + b for a, b in zip(xs, ys, strict=True)],
        [b * a for a, b in zip(xs, ys, strict=True)],
        [torch.where(a > 0, a, b) for a, b in zip(xs, ys, strict=True)],
    ]
    for out, want in zip((x + y, y * x, raggedfn.where(x > 0, x, y)), wants, strict=True):
        got = _samples(out)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


def test_broadcasting_checks_the_sizes_of_an_axis_two_operands_share() -> None:
    # z is ragged along both axes; x owns the first with other lengths: refused, never
    # gathered with the wrong rows
    x = raggedfn.from_list([torch.ones(2, 1), torch.ones(3, 1)], ragged_dims=(1,))
    y = raggedfn.from_list([torch.ones(1, 2), torch.ones(1, 1)], ragged_dims=(2,))
    z = raggedfn.from_list([torch.ones(3, 2), torch.ones(2, 1)], ragged_dims=(1, 2))
    with pytest.raises(RaggedError, match="sizes along axis 1"):
        x + z
    with pytest.raises(RaggedError, match="sizes along axis 1"):
        raggedfn.where(x > 0, y, z)
    # and the same shapes with matching lengths broadcast as torch does per sample
    x = raggedfn.from_list([torch.full((3, 1), 2.0), torch.full((2, 1), 3.0)], ragged_dims=(1,))
    for got, a, c in zip(_samples(x + z), _samples(x), _samples(z), strict=True):
        assert torch.equal(got, a + c)
