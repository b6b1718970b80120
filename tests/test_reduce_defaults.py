"""Default arguments and ``keepdim`` of the public reductions, as torch's on every sample.

``var``/``std`` without ``correction`` (Bessel's, as ``torch.var``), ``norm`` with
``p="fro"``, and ``keepdim=True`` of the extrema and their indices over a dense axis
and over everything (``dim=None``), each against torch's op on every sample alone
(or on all the values for ``dim=None``).
"""

from __future__ import annotations

import pytest
import torch

import raggedfn
from raggedfn import Ragged

LENGTHS = [3, 2, 4]


def tokens(seed: int = 0) -> Ragged:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(LENGTHS), 3, generator=gen, dtype=torch.float64)
    return raggedfn.from_lengths(values, torch.tensor(LENGTHS))


def per_sample(x: Ragged) -> list[torch.Tensor]:
    return list(torch.split(x.values, LENGTHS))


@pytest.mark.parametrize("name", ["var", "std"])
def test_spread_defaults_to_bessels_correction_as_torch(name: str) -> None:
    x = tokens()
    op, torch_op = getattr(raggedfn, name), getattr(torch, name)
    want = torch.stack([torch_op(s, 0) for s in per_sample(x)])
    torch.testing.assert_close(op(x, 1), want)
    torch.testing.assert_close(op(x), torch_op(x.values))  # dim=None: every value
    torch.testing.assert_close(op(x, 1, correction=0), torch.stack([torch_op(s, 0, correction=0) for s in per_sample(x)]))  # fmt: skip


def test_norm_fro_is_the_two_norm_as_torch() -> None:
    x = tokens()
    want = torch.stack([torch.norm(s, p="fro", dim=0) for s in per_sample(x)])
    torch.testing.assert_close(raggedfn.norm(x, "fro", 1), want)
    torch.testing.assert_close(raggedfn.norm(x, "fro"), torch.norm(x.values, p="fro"))


@pytest.mark.parametrize("name", ["amax", "amin", "argmax", "argmin"])
def test_keepdim_over_a_dense_axis_as_torch(name: str) -> None:
    x = tokens()
    out = getattr(raggedfn, name)(x, 2, keepdim=True)
    assert isinstance(out, Ragged)
    for got, s in zip(torch.split(out.values, LENGTHS), per_sample(x), strict=True):
        want = getattr(torch, name)(s, 1, keepdim=True)
        assert got.shape == want.shape
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["amax", "amin"])
def test_keepdim_over_everything_as_torch(name: str) -> None:
    x = tokens()
    out = getattr(raggedfn, name)(x, keepdim=True)
    assert out.shape == (1, 1, 1)  # (B, N*, 3) with every axis kept
    assert torch.equal(out.flatten(), getattr(torch, name)(x.values).flatten())
    assert getattr(raggedfn, name)(x).shape == ()


def test_norm_without_p_is_the_two_norm_as_torch() -> None:
    x = tokens(3)
    want = torch.stack([torch.linalg.vector_norm(s, dim=0) for s in per_sample(x)])
    torch.testing.assert_close(raggedfn.norm(x, dim=1), want)
    torch.testing.assert_close(raggedfn.norm(x), torch.linalg.vector_norm(x.values))
