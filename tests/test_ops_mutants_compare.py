"""Tests that kill surviving mutants of the public ops (``raggedfn/ops/``).

Each test compares with the per-sample torch computation (or asserts a specific
error) and names the mutant it kills.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import raggedfn
from property_tests.reference import assert_same, loop
from raggedfn import RaggedError


def _tokens(lengths=(3, 1, 4), dim=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return raggedfn.from_list([torch.randn(n, dim, generator=gen) for n in lengths])


# kills raggedfn.ops._grouped.x_group_by__mutmut_52 (counts on device=None, the
# default device, instead of the device of ids): under another default device
# the counts must still be built next to the rows.
def test_group_by_builds_counts_on_the_device_of_ids_not_the_default_device():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(7, 3, generator=gen)
    ids = torch.tensor([2, 0, 2, 1, 0, 2, 2])
    with torch.device("meta"):
        grouped, order = raggedfn.group_by(values, ids, 4)
    assert grouped.values.device == values.device
    assert grouped.sizes.device == values.device
    assert grouped.offsets.device == values.device
    expected = [values[ids == g] for g in range(4)]
    assert_same(grouped, expected)
    assert order.tolist() == [1, 4, 3, 0, 2, 5, 6]


# kills raggedfn.ops._compare.x_lt__mutmut_9 (_binary(None, ...)): the error
# names the op ``lt``.
def test_lt_errors_name_the_op():
    with pytest.raises(RaggedError, match=r"^lt: needs a Ragged or tensor operand"):
        raggedfn.lt(1, 2)
    x = _tokens((3, 1))
    y = _tokens((2, 2))
    with pytest.raises(RaggedError, match=r"^lt: "):
        raggedfn.lt(x, y)
    # and the result itself is the per-sample torch comparison
    z = _tokens((3, 1), seed=5)
    assert_same(raggedfn.lt(x, z), loop(torch.lt, x, z))


# kills raggedfn.ops._products.xǁ_Specǁencode__mutmut_9 ("XXXX".join of the
# ragged letters of one operand): the traced-code branch of einsum encodes the
# spec for its opaque op; an operand with two ragged axes must round-trip.
# Eager, with torch.compiler.is_compiling patched to True (einsum then takes
# _compiled, whose opaque op runs the bucketed plan eagerly).
def test_einsum_opaque_branch_with_two_ragged_axes_per_operand_is_per_sample(monkeypatch):
    x = _tokens((3, 1, 2), dim=2)
    pair = raggedfn.einsum("bid,bjd->bij", x, x)  # (B, N*, N*)
    assert pair.layout.num_ragged == 2
    expected = loop(lambda p: torch.einsum("ik,jk->ij", p, p), pair)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out = raggedfn.einsum("bik,bjk->bij", pair, pair)
    assert_same(out, expected)


# kills raggedfn.ops._products.x_einsum__mutmut_118 (the nested letters of the
# operand dropped from the result's layout): a weight applied to a nested value
# keeps its nesting (layout, partitions) and equals the per-row product.
def test_einsum_with_a_weight_keeps_the_nested_layout_of_documents():
    gen = torch.Generator().manual_seed(4)
    docs = raggedfn.from_list(
        [[torch.randn(n, 3, generator=gen) for n in doc] for doc in ([2, 3], [], [1])]
    )
    weight = torch.randn(3, 5, generator=gen)
    out = raggedfn.einsum("bstd,de->bste", docs, weight)
    assert out.layout == docs.layout
    assert out.shape == (3, None, None, 5)
    assert torch.equal(out.sizes, docs.sizes)
    assert torch.equal(out.offsets, docs.offsets)
    assert len(out.row_offsets) == len(docs.row_offsets)
    for a, b in zip(out.row_offsets, docs.row_offsets, strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(out.values, docs.values @ weight)


# kills raggedfn.ops._nn.x__normalized__mutmut_3 (tuple(None) for a torch.Size):
# a torch.Size normalized_shape (as x.shape[-1:] of a tensor gives) works as in torch.
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norms_accept_a_torch_size_as_normalized_shape(op):
    x = _tokens(dim=4)
    shape = torch.Size([4])
    weight = torch.linspace(0.5, 1.5, 4)
    if op == "layer_norm":
        out = raggedfn.layer_norm(x, shape, weight, torch.zeros(4))
        expected = loop(lambda t: F.layer_norm(t, shape, weight, torch.zeros(4)), x)
    else:
        out = raggedfn.rms_norm(x, shape, weight)
        expected = loop(lambda t: F.rms_norm(t, shape, weight), x)
    assert_same(out, expected)
