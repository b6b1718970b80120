"""Size checks that a batch of zero samples, a size of one or a short index must not slip past.

``einsum`` compares every Ragged operand's batch size with the first one's, also
when the first has no samples; ``group_by`` refuses ids of another length than the
rows; ``unflatten`` infers a ``-1`` next to sizes whose
product is 1 (as ``torch.unflatten``) and refuses one next to a 0.
"""

from __future__ import annotations

import pytest
import torch

import raggedfn
from raggedfn import RaggedError


def test_einsum_refuses_operands_with_zero_and_three_samples() -> None:
    empty = raggedfn.from_lengths(torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64))
    three = raggedfn.from_lengths(torch.ones(4, 2), torch.tensor([1, 2, 1]))
    with pytest.raises(RaggedError, match="operand 1 has 3 samples, expected 0"):
        raggedfn.einsum("bnd,bnd->bn", empty, three)


@pytest.mark.parametrize("sizes", [(-1, 1), (1, -1, 1), (-1,)])
def test_unflatten_infers_minus_one_beside_ones_as_torch(sizes: tuple[int, ...]) -> None:
    values = torch.arange(15.0).reshape(5, 3)
    x = raggedfn.from_lengths(values, torch.tensor([3, 2]))
    out = raggedfn.unflatten(x, 2, sizes)
    for got, sample in zip(
        torch.split(out.values, [3, 2]), torch.split(values, [3, 2]), strict=True
    ):
        assert torch.equal(got, torch.unflatten(sample, 1, sizes))


def test_unflatten_refuses_minus_one_beside_zero() -> None:
    x = raggedfn.from_lengths(torch.zeros(5, 0), torch.tensor([3, 2]))
    with pytest.raises(RaggedError, match="cannot hold 0 elements"):
        raggedfn.unflatten(x, 2, (0, -1))


def test_group_by_refuses_ids_of_another_length_than_the_rows() -> None:
    with pytest.raises(RaggedError, match="group_by"):
        raggedfn.group_by(torch.zeros(4, 2), torch.tensor([0, 1, 1]), 2)
