"""from_padded(mask=), positions and segment_ids against Python loops (issue #17)."""

import pytest
import torch

import raggedfn
from property_tests.reference import pad_by_hand, samples
from raggedfn import RaggedError

I64 = torch.int64


# ----- from_padded(mask=) -----------------------------------------------------------------


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mask_dtype", [I64, torch.bool, torch.int32])
def test_attention_mask_round_trip(side, mask_dtype):
    tokens = [torch.randint(1, 100, (n,)) for n in (3, 7, 1, 0, 5)]
    padded, attention_mask = pad_by_hand(tokens, side, 8, fill=-1)
    x = raggedfn.from_padded(padded, mask=attention_mask.to(mask_dtype))
    assert x.shape == (5, None) and x.lengths.tolist() == [3, 7, 1, 0, 5]
    for got, want in zip(samples(x), tokens, strict=True):
        assert torch.equal(got, want)
    assert not bool((x.values == -1).any())
    # and back: to_padded + mask (right padding) give the same tokens again
    again = raggedfn.from_padded(raggedfn.to_padded(x), mask=raggedfn.mask(x))
    assert torch.equal(again.values, x.values) and torch.equal(again.offsets, x.offsets)


def test_lengths_of_a_left_padded_batch_are_not_the_tokens():
    """Why the mask form exists: lengths keep the first rows, the mask the marked ones."""
    padded, attention_mask = pad_by_hand([torch.tensor([5, 6]), torch.tensor([7])], "left", 3)
    by_lengths = raggedfn.from_padded(padded, attention_mask.sum(1))
    by_mask = raggedfn.from_padded(padded, mask=attention_mask)
    assert by_mask.values.tolist() == [5, 6, 7]
    assert by_lengths.values.tolist() != by_mask.values.tolist()


def test_mask_with_features_holes_and_gradients():
    padded = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    keep = torch.tensor([[True, False, True, True], [False, True, False, False]])
    x = raggedfn.from_padded(padded, mask=keep)
    assert x.shape == (2, None, 3) and x.lengths.tolist() == [3, 1]
    want = [padded[b][keep[b]] for b in range(2)]
    for got, w in zip(samples(x), want, strict=True):
        assert torch.equal(got, w)
    (x.values * torch.arange(12.0, dtype=torch.float64).reshape(4, 3)).sum().backward()
    expected = torch.zeros(2, 4, 3, dtype=torch.float64)
    expected[keep] = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
    assert torch.equal(padded.grad, expected)


def test_mask_along_another_ragged_axis():
    # (B, D, L*): a channels-first batch ragged along logical axis 2
    padded = torch.randn(3, 2, 5)
    keep = torch.tensor([[1, 1, 0, 0, 0], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    x = raggedfn.from_padded(padded, ragged_dims=2, mask=keep)
    assert x.shape == (3, 2, None) and x.sizes[:, 0].tolist() == [2, 4, 0]
    for b, got in enumerate(samples(x)):
        assert torch.equal(got, padded[b][:, keep[b].bool()])


def test_empty_batch_and_all_padding():
    x = raggedfn.from_padded(torch.zeros(0, 4, 2), mask=torch.zeros(0, 4, dtype=I64))
    assert x.batch_size == 0 and x.values.shape == (0, 2)
    y = raggedfn.from_padded(torch.zeros(2, 3), mask=torch.zeros(2, 3, dtype=torch.bool))
    assert y.lengths.tolist() == [0, 0] and raggedfn.check(y) is y


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one of lengths_or_sizes and mask, got neither"),
        ({"lengths_or_sizes": [1, 2], "mask": torch.ones(2, 3)}, "got both"),
        ({"mask": torch.ones(2, 3)}, r"bool or 0/1 integer tensor, got a torch.float32"),
        ({"mask": torch.tensor([[1, 2, 0], [1, 1, 1]])}, r"only 0 and 1, got mask\[0, 1\] = 2"),
        ({"mask": torch.tensor([[1, -1, 0], [1, 1, 1]])}, r"mask\[0, 1\] = -1"),
        ({"mask": torch.ones(2, 4, dtype=I64)}, r"shape \[B, L\] = \[2, 3\]"),
        ({"mask": torch.ones(3, dtype=I64)}, r"shape \[B, L\] = \[2, 3\]"),
        ({"mask": [[1, 1, 1], [1, 1, 1]]}, "got list"),
        ({"mask": torch.ones(2, 3, dtype=I64), "ragged_dims": (1, 2)}, "one ragged axis"),
        ({"mask": torch.ones(2, 3, dtype=I64), "ragged_dims": 0}, "batch axis"),
    ],
)
def test_bad_masks_raise(kwargs, match):
    padded = torch.zeros(2, 3, 4)
    with pytest.raises(RaggedError, match=match):
        raggedfn.from_padded(padded, **kwargs)


def test_lengths_form_is_kept():
    x = raggedfn.from_padded(torch.arange(6.0).reshape(2, 3), torch.tensor([1, 3]))
    assert x.values.tolist() == [0.0, 3.0, 4.0, 5.0]
    pairs = raggedfn.from_padded(torch.zeros(2, 3, 3), [[1, 1], [3, 3]], ragged_dims=(1, 2))
    assert pairs.sizes.tolist() == [[1, 1], [3, 3]]


# ----- positions and segment_ids -----------------------------------------------------


def test_positions_and_segment_ids_of_tokens_against_loops():
    lengths = [3, 0, 1, 4]
    x = raggedfn.from_lengths(torch.randn(8, 2), lengths)
    pos = raggedfn.positions(x)
    assert pos.shape == (4, None) and pos.dtype == I64
    assert torch.equal(pos.offsets, x.offsets) and torch.equal(pos.sizes, x.sizes)
    want_pos, want_ids = [], []
    for i, n in enumerate(lengths):
        for p in range(n):
            want_pos.append(p)
            want_ids.append(i)
    assert pos.values.tolist() == want_pos
    ids = raggedfn.segment_ids(x)
    assert ids.dtype == I64 and ids.tolist() == want_ids


def test_positions_of_pair_states_along_each_axis():
    x = raggedfn.from_list([torch.zeros(2, 3, 4), torch.zeros(1, 2, 4)], ragged_dims=(1, 2))
    rows = raggedfn.positions(x, dim=-3)  # logical (B, N*, M*, 4)
    assert rows.shape == (2, None, None)
    for i, (r, c) in enumerate(zip(samples(rows), samples(raggedfn.positions(x, 2)), strict=True)):
        n, m = x.sizes[i].tolist()
        assert r.tolist() == [[a for _ in range(m)] for a in range(n)]
        assert c.tolist() == [list(range(m)) for _ in range(n)]
    assert torch.equal(rows.values, raggedfn.positions(x, 1).values)
    assert raggedfn.segment_ids(x).tolist() == [0] * 6 + [1] * 2


def test_positions_follow_a_transposed_layout():
    x = raggedfn.from_list([torch.zeros(2, 3), torch.zeros(4, 1)], ragged_dims=(1, 2))
    t = raggedfn.transpose(x, 1, 2)  # logical (B, M*, N*): only the layout changes
    for s, got in zip(samples(t), samples(raggedfn.positions(t, dim=1)), strict=True):
        assert got.tolist() == [[a] * s.shape[1] for a in range(s.shape[0])]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda x, p: raggedfn.positions(p), "pass dim= to say which one"),
        (lambda x, p: raggedfn.positions(x, dim=2), "dim 2 is a dense axis"),
        (lambda x, p: raggedfn.positions(x, dim=3), "out of range"),
        (lambda x, p: raggedfn.positions(x, dim=0), "batch axis"),
        (lambda x, p: raggedfn.positions(x.values), "must be a Ragged value"),
        (lambda x, p: raggedfn.segment_ids(x.offsets), "must be a Ragged value"),
    ],
)
def test_positions_and_segment_ids_errors(call, match):
    x = raggedfn.from_lengths(torch.zeros(3, 2), [1, 2])
    p = raggedfn.from_list([torch.zeros(2, 2)], ragged_dims=(1, 2))
    with pytest.raises(RaggedError, match=match):
        call(x, p)


def test_positions_and_segment_ids_compile_once_over_new_lengths():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    def f(x):
        return raggedfn.positions(x).values * 10 + raggedfn.segment_ids(x)

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="eager")
    for lengths in ([3, 2, 4], [5, 2, 6, 3], [2, 7]):
        x = raggedfn.from_lengths(torch.zeros(sum(lengths), 2), lengths)
        raggedfn.mark_dynamic(x)
        assert torch.equal(compiled(x), f(x))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_from_nested_refuses_a_jagged_tensor_ragged_along_another_axis():
    njt = torch.nested.nested_tensor_from_jagged(torch.randn(5, 2), torch.tensor([0, 2, 5]))
    moved = njt.transpose(1, 2)  # (B, 2, N*): ragged along axis 2
    with pytest.raises(RaggedError, match="only a jagged tensor ragged along axis 1"):
        raggedfn.from_nested(moved)
