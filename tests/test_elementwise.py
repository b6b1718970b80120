"""Elementwise ops and broadcasting: behaviour, errors and immutability."""

from __future__ import annotations

import pytest
import torch

import raggedfn
from raggedfn import RaggedError


def tokens(lengths=(2, 3), dim=4, dtype=torch.float64):
    total = sum(lengths)
    values = torch.arange(total * dim, dtype=dtype).reshape(total, dim)
    return raggedfn.from_lengths(values, list(lengths))


def test_same_partition_objects_share_offsets() -> None:
    x = tokens()
    y = x + x
    assert y.offsets is x.offsets and y.sizes is x.sizes
    torch.testing.assert_close(y.values, 2 * x.values)


def test_equal_valued_partitions_are_accepted_after_a_check() -> None:
    x = tokens()
    y = raggedfn.from_lengths(torch.ones(5, 4, dtype=torch.float64), [2, 3])
    assert y.offsets is not x.offsets
    torch.testing.assert_close((x - y).values, x.values - 1)


def test_mismatched_partitions_raise() -> None:
    x = tokens((2, 3))
    y = tokens((3, 2))
    with pytest.raises(RaggedError, match=r"add: operands have different partitions: sizes"):
        raggedfn.add(x, y)
    with pytest.raises(
        RaggedError, match=r"mul: operands have different partitions: batch sizes 3 and 2"
    ):
        raggedfn.mul(tokens((1, 1, 3)), x)
    with pytest.raises(RaggedError, match=r"sub: operand 1 has logical shape \(2, None\)"):
        raggedfn.sub(x, raggedfn.from_lengths(torch.zeros(5), [2, 3]))


def test_bad_dense_operands_raise() -> None:
    x = tokens()
    with pytest.raises(
        RaggedError, match=r"add: operands have sizes \[3, 4\] along dense logical axis 2"
    ):
        x + torch.ones(3)
    with pytest.raises(RaggedError, match=r"has 3 along the batch axis, expected 2 or 1"):
        x + torch.ones(3, 1, 4)
    with pytest.raises(
        RaggedError, match=r"operand 1 has size 5 along logical axis 1, which is ragged"
    ):
        x + torch.ones(5, 4)
    with pytest.raises(RaggedError, match=r"more axes than the logical shape"):
        x + torch.ones(1, 2, 1, 4)
    with pytest.raises(
        RaggedError, match=r"div: operand 1 must be a Ragged value, a tensor or a number, got list"
    ):
        raggedfn.div(x, [1.0])


def test_wrong_device_raises() -> None:
    x = tokens()
    with pytest.raises(RaggedError, match=r"add: operand 1 is on meta, expected cpu"):
        x + torch.ones(4, device="meta")


def test_where_needs_a_bool_condition() -> None:
    x = tokens()
    with pytest.raises(
        RaggedError,
        match=r"where: condition must be a bool Ragged value or tensor, got a torch.float64",
    ):
        raggedfn.where(x, x, 0.0)
    assert raggedfn.where(x > 3, x, 0.0).dtype == torch.float64


def test_apply_checks_the_result() -> None:
    x = tokens()
    with pytest.raises(
        RaggedError,
        match=r"apply: fn must return a tensor with 5 packed rows, got a torch.float64 tensor of shape \(4,\)",
    ):
        raggedfn.apply(lambda v: v.sum(0), x)
    with pytest.raises(RaggedError, match=r"apply: fn must be callable"):
        raggedfn.apply(3, x)
    image = raggedfn.from_list([torch.zeros(3, 2, 2)], ragged_dims=(2, 3))
    with pytest.raises(RaggedError, match=r"apply: fn changed the number of dense axes \(1 -> 0\)"):
        raggedfn.apply(lambda v: v.sum(-1), image)


def test_apply_sees_dense_axes_in_logical_order() -> None:
    x = raggedfn.transpose(raggedfn.from_list([torch.zeros(2, 3, 4)]), 2, 3)
    seen = []
    raggedfn.apply(lambda v: seen.append(v.shape) or v, x)
    assert seen == [torch.Size([2, 4, 3])]


def test_no_input_is_modified() -> None:
    x = tokens()
    y = tokens()
    bias = torch.ones(4, dtype=torch.float64)
    before = (x.values._version, y.values._version, bias._version)
    for op in [raggedfn.add, raggedfn.sub, raggedfn.mul, raggedfn.div, raggedfn.pow]:
        op(x, y)
        op(x, bias)
        op(2.0, x)
    raggedfn.where(x > 1, x, y)
    raggedfn.neg(x)
    raggedfn.abs(x)
    raggedfn.apply(torch.relu, x)
    raggedfn.unsqueeze(x, 2) * raggedfn.unsqueeze(y, 1)
    assert (x.values._version, y.values._version, bias._version) == before


def test_dense_only_operands_fall_back_to_torch() -> None:
    a = torch.ones(3)
    assert torch.equal(raggedfn.add(a, a), a + a)
    with pytest.raises(RaggedError, match=r"add: needs a Ragged or tensor operand"):
        raggedfn.add(1, 2)


def test_broadcast_creates_pair_state_without_padding() -> None:
    x = tokens((2, 0, 3))
    y = tokens((1, 4, 2))
    pair = raggedfn.unsqueeze(x, 2) + raggedfn.unsqueeze(x, 1)
    assert pair.shape == (3, None, None, 4)
    assert pair.sizes.tolist() == [[2, 2], [0, 0], [3, 3]]
    assert pair.values.shape == (13, 4)
    cross = raggedfn.unsqueeze(x, 2) * raggedfn.unsqueeze(y, 1)
    assert cross.sizes.tolist() == [[2, 1], [0, 4], [3, 2]]
    assert cross.values.shape == (8, 4)
    expected = x[2].unsqueeze(1) * y[2].unsqueeze(0)
    torch.testing.assert_close(cross[2], expected)


def test_broadcast_against_ragged_needs_equal_sizes() -> None:
    pair = raggedfn.unsqueeze(tokens((2, 3)), 2) + raggedfn.unsqueeze(tokens((2, 3)), 1)
    with pytest.raises(
        RaggedError, match=r"add: operands have different partitions: sizes along axis 1"
    ):
        pair + raggedfn.unsqueeze(tokens((3, 2)), 2)


def test_broadcast_tensors_needs_a_ragged_operand() -> None:
    with pytest.raises(RaggedError, match=r"broadcast_tensors: needs at least one Ragged operand"):
        raggedfn.broadcast_tensors(torch.ones(2))
