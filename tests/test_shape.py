"""Shape ops: layout-only exchanges, errors and immutability."""

from __future__ import annotations

import pytest
import torch

import raggedfn
from raggedfn import Layout, RaggedError


def pair_state():
    return raggedfn.from_list(
        [torch.randn(2, 2, 3, dtype=torch.float64), torch.randn(3, 3, 3, dtype=torch.float64)],
        ragged_dims=(1, 2),
    )


def test_transposing_ragged_axes_is_layout_only() -> None:
    x = pair_state()
    y = raggedfn.transpose(x, 1, 2)
    assert y.values is x.values and y.offsets is x.offsets
    torch.testing.assert_close(y[1], x[1].transpose(0, 1))
    z = raggedfn.transpose(y, -3, -2)
    assert z.layout == x.layout


def test_contiguous_moves_data_only_when_needed() -> None:
    x = pair_state()
    assert raggedfn.contiguous(x).values is x.values
    y = raggedfn.contiguous(raggedfn.transpose(x, 1, 2))
    assert y.layout == Layout.standard(2, 1)
    torch.testing.assert_close(y[1], x[1].transpose(0, 1))


def test_flatten_of_adjacent_dense_axes_is_a_view() -> None:
    x = raggedfn.from_list([torch.zeros(2, 3, 4)])
    y = raggedfn.flatten(x, 2)
    assert y.shape == (1, None, 12)
    assert y.values.data_ptr() == x.values.data_ptr()


def test_axis_errors() -> None:
    x = pair_state()
    with pytest.raises(
        RaggedError, match=r"transpose: axis 4 is out of range for a sample of rank 3"
    ):
        raggedfn.transpose(x, 1, 4)
    with pytest.raises(RaggedError, match=r"transpose: axis 0 is the batch axis"):
        raggedfn.transpose(x, 0, 1)
    with pytest.raises(RaggedError, match=r"permute: dims \(0, 2, 1\) must have 4 entries"):
        raggedfn.permute(x, (0, 2, 1))
    with pytest.raises(
        RaggedError, match=r"permute: dims \(1, 0, 2, 3\) must keep the batch axis 0 first"
    ):
        raggedfn.permute(x, (1, 0, 2, 3))
    with pytest.raises(RaggedError, match=r"permute: dims \(0, 1, 1, 2\) must be a permutation"):
        raggedfn.permute(x, (0, 1, 1, 2))
    with pytest.raises(RaggedError, match=r"unsqueeze: dim 0 would go before the batch axis"):
        raggedfn.unsqueeze(x, 0)
    with pytest.raises(RaggedError, match=r"unsqueeze: dim 5 is out of range"):
        raggedfn.unsqueeze(x, 5)


def test_ragged_axes_cannot_be_reshaped() -> None:
    x = pair_state()
    with pytest.raises(RaggedError, match=r"squeeze: axis 1 is ragged"):
        raggedfn.squeeze(x, 1)
    with pytest.raises(
        RaggedError, match=r"flatten: axis 1 is ragged \(logical shape \(N\*, M\*, 3\)\)"
    ):
        raggedfn.flatten(x, 1, 3)
    with pytest.raises(RaggedError, match=r"flatten: start_dim 3 comes after end_dim 2"):
        raggedfn.flatten(x, 3, 2)
    with pytest.raises(RaggedError, match=r"unflatten: axis 2 is ragged"):
        raggedfn.unflatten(x, 2, (1, 1))
    with pytest.raises(RaggedError, match=r"unflatten: sizes \(2, 2\) has 4 elements, expected 3"):
        raggedfn.unflatten(x, 3, (2, 2))
    with pytest.raises(RaggedError, match=r"unflatten: sizes \(-1, -1\) may hold at most one -1"):
        raggedfn.unflatten(x, 3, (-1, -1))
    with pytest.raises(
        RaggedError, match=r"reshape: shape \(2, None, 3\) must mark the 2 ragged axes"
    ):
        raggedfn.reshape(x, (2, None, 3))
    with pytest.raises(
        RaggedError, match=r"reshape: shape \(3, None, None, 3\) must start with the batch size 2"
    ):
        raggedfn.reshape(x, (3, None, None, 3))
    with pytest.raises(RaggedError, match=r"group \(2,\) has 2 elements, expected 3"):
        raggedfn.reshape(x, (2, None, None, 2))
    with pytest.raises(
        RaggedError, match=r"contiguous: x must be a Ragged value, got a torch.float32"
    ):
        raggedfn.contiguous(torch.zeros(2))


def test_no_input_is_modified() -> None:
    x = raggedfn.transpose(raggedfn.from_list([torch.zeros(2, 3, 4), torch.zeros(1, 3, 4)]), 2, 3)
    x = x.with_values(x.values.detach().requires_grad_(True))
    before = x.values._version
    raggedfn.flatten(x, 2, 3)
    raggedfn.unflatten(x, 2, (2, 2))
    raggedfn.reshape(x, (2, None, 12))
    raggedfn.contiguous(x)
    raggedfn.squeeze(raggedfn.unsqueeze(x, 1))
    raggedfn.permute(x, (0, 3, 2, 1))
    assert x.values._version == before


@pytest.mark.parametrize("dims", [(0, 2, 3, 1), (0, 3, 1, 2), (0, -1, -3, -2)])
def test_permute_by_a_three_cycle_moves_axis_dims_i_to_i(dims) -> None:
    """A 3-cycle is not its own inverse: axis i of the result is axis dims[i] of x."""
    x = raggedfn.from_list(
        [torch.arange(24.0).reshape(2, 3, 4), torch.arange(60.0).reshape(3, 4, 5)],
        ragged_dims=(1, 2, 3),
    )
    y = raggedfn.permute(x, dims)
    assert y.values is x.values
    order = [d % 4 - 1 for d in dims[1:]]
    for i in range(2):
        assert torch.equal(y[i], x[i].permute(*order))
    dense = raggedfn.from_list([torch.arange(24.0).reshape(2, 3, 4)])
    assert torch.equal(raggedfn.permute(dense, dims)[0], dense[0].permute(*order))
