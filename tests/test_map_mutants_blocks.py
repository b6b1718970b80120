"""``raggedfn.map`` behaviour of ``raggedfn/_map/running/`` that ``make mutate`` found
untested (docs/testing.md).

Each test compares ``map`` with the per-sample loop (``property_tests.reference.loop``)
and names the surviving mutant it kills; each was seen failing with that mutant applied.
"""

from __future__ import annotations

import torch

import raggedfn
from property_tests.reference import assert_same, loop

D = 4


def tokens(lengths, dim=D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return raggedfn.from_list(
        [torch.randn(n, dim, generator=gen, dtype=torch.float64) for n in lengths]
    )


# ----- _split._trailing_as_ragged -------------------------------------------------------


def _two_channel_scores(t):
    # eagerly (n, 2, min(3, n)): axes 0 and 2 ragged; the plan under the guard n >= 3
    # has the last axis of fixed size 3, behind the fixed axis of size 2 (dense axis 1)
    s = t @ t.narrow(0, 0, min(3, t.shape[0])).T
    return s[:, None, :] * torch.arange(1.0, 3.0, dtype=t.dtype).view(2, 1)


def test_the_dynamo_branch_makes_a_second_trailing_fixed_axis_ragged(monkeypatch):
    """Kills ``_split.x__trailing_as_ragged__mutmut_34`` (``shape[1 - j]``): the side of
    a fixed axis made ragged is read at its own dense axis; with the mutant the axis
    behind another fixed one (dense axis 1) took the packed row count as its side and the
    reshape failed. (The axis right after the ragged one, dense axis 0, reads the same
    either way: test_the_dynamo_branch_makes_a_trailing_fixed_axis_ragged_as_eagerly.)"""
    x = tokens((5, 6))
    eager = raggedfn.map(_two_channel_scores, x)
    assert eager.layout == raggedfn.Layout.from_ragged_positions(3, (0, 2))
    assert_same(eager, loop(_two_channel_scores, x))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # map's dynamo branch
    for lengths in ((5, 6), (3, 4, 7), (4, 3)):
        x = tokens(lengths)
        got = raggedfn.map(_two_channel_scores, x)
        assert isinstance(got, raggedfn.Ragged) and got.layout == eager.layout
        assert_same(got, loop(_two_channel_scores, x))
