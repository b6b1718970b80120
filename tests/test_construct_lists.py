"""``from_list`` of lists holding ``Ragged`` values: a ``Ragged`` at any list level counts
as the list of its samples (``_construct_lists``). Each result is read back sample by
sample with ``unbind`` and compared with the tensors the lists hold."""

from __future__ import annotations

import pytest
import torch

import raggedfn
from raggedfn import RaggedError

D = 3


def _tensors(*rows, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, D, generator=gen) for n in rows]


def _read_back(x, depth):
    """``x`` as nested Python lists of tensors, ``depth`` list levels deep."""
    if depth == 1:
        return list(raggedfn.unbind(x))
    return [_read_back(x[i], depth - 1) for i in range(x.batch_size)]


def _assert_lists_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if isinstance(w, list):
            _assert_lists_equal(g, w)
        else:
            assert g.shape == w.shape and torch.equal(g, w)


def test_a_ragged_inside_a_list_sample_counts_as_the_list_of_its_samples():
    a0, a1, b0, c0 = _tensors(2, 1, 4, 3)
    a, b = raggedfn.from_list([a0, a1]), raggedfn.from_list([b0])
    x = raggedfn.from_list([[a, b], [b, [c0]], []])
    want = [[[a0, a1], [b0]], [[b0], [c0]], []]
    assert x.shape == (3, None, None, None, D)
    _assert_lists_equal(_read_back(x, 3), want)
    assert torch.equal(x.values, torch.cat([a0, a1, b0, b0, c0]))


def test_a_nested_ragged_inside_a_list_sample():
    a0, a1, b0 = _tensors(2, 1, 4, seed=1)
    docs = raggedfn.from_list([[a0, a1], [b0]])  # documents of sentences: nested
    x = raggedfn.from_list([[docs], [[[b0]]]])
    want = [[[[a0, a1], [b0]]], [[[b0]]]]
    assert x.shape == (2, None, None, None, None, D)
    _assert_lists_equal(_read_back(x, 4), want)


def test_an_empty_ragged_inside_a_list_sample_has_its_depth():
    (b0,) = _tensors(4, seed=2)
    empty = raggedfn.from_lengths(torch.empty(0, D), torch.zeros(0, dtype=torch.int64))
    x = raggedfn.from_list([[empty], [raggedfn.from_list([b0])]])
    _assert_lists_equal(_read_back(x, 3), [[[]], [[b0]]])
    only = raggedfn.from_list([[empty]])  # no tensor at all: dtype and shape from it
    assert only.shape == (1, None, None, None, D) and only.values.shape == (0, D)


def test_a_ragged_beside_a_tensor_in_one_list_is_refused():
    a0, t = _tensors(2, 3, seed=3)
    with pytest.raises(RaggedError, match="every tensor must sit at nesting depth 3"):
        raggedfn.from_list([[raggedfn.from_list([a0]), t]])
