"""Output structure of ``raggedfn.map`` inside ``torch.compile``: a plan under guards
(``t.narrow(0, 0, min(3, n))`` holds for ``n >= 3``, ``len(t)`` pins the size) has fixed
output sizes that the output structure makes ragged; compiled code gives the same
``Ragged`` as eager code (it gave a dense ``[B, 3, C]`` tensor) and the loop's values."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import raggedfn
from property_tests.map_oracle import assert_restacked

# unlike the first batch's B, B + 1 and T: duck sizing would tie their symbols
D = 7

pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)


def _batch(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    samples = [torch.randn(n, D, generator=gen, dtype=torch.float64) for n in lengths]
    return raggedfn.from_list(samples), samples


def _head_of_three(t):
    return t.narrow(0, 0, min(3, t.shape[0])) * 2


def _all_but_last(t):
    return t[: len(t) - 1] + 1


@pytest.mark.parametrize(
    ("f", "batches"),
    [
        # guard n >= 3: every batch of samples with 3 rows or more
        (_head_of_three, [[5, 6], [3, 4, 7], [6, 3], [3, 3, 3, 3]]),
        # len(t) pins n to the first trace's 5: batches of samples of 5 rows
        (_all_but_last, [[5, 5], [5, 5, 5]]),
    ],
    ids=["narrow_min", "pinned_len"],
)
def test_compiled_map_has_the_eager_output_structure(f, batches):
    def step(values, offsets, sizes):
        x = raggedfn.Ragged(values, offsets, sizes, raggedfn.Layout.standard(1, 1))
        return raggedfn.map(f, x)

    first, _ = _batch(batches[0], 0)
    eager = step(first.values, first.offsets, first.sizes)  # traces f eagerly
    assert isinstance(eager, raggedfn.Ragged)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    for n, lengths in enumerate(batches):
        x, samples = _batch(lengths, n)
        got = compiled(x.values, x.offsets, x.sizes)
        assert isinstance(got, raggedfn.Ragged) and got.layout == eager.layout
        assert_restacked(got, [f(s.clone()) for s in samples])
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def _scores_against_the_first_three(t):
    return t @ t.narrow(0, 0, min(3, t.shape[0])).T  # (n, min(3, n))


def _scores_against_the_first_three_per_channel(t):
    scores = t @ t.narrow(0, 0, min(3, t.shape[0])).T
    return scores[:, :, None] * torch.arange(1.0, 3.0, dtype=t.dtype)  # (n, min(3, n), 2)


def _scores_of_the_first_three(t):
    return t.narrow(0, 0, min(3, t.shape[0])) @ t.T  # (min(3, n), n)


def _pair_step(f):
    def step(values, offsets, sizes):
        x = raggedfn.Ragged(values, offsets, sizes, raggedfn.Layout.standard(1, 1))
        return raggedfn.map(f, x)

    return step


@pytest.mark.parametrize(
    "f",
    [_scores_against_the_first_three, _scores_against_the_first_three_per_channel],
    ids=["scores", "per_channel"],
)
def test_compiled_map_makes_a_trailing_fixed_axis_ragged_as_eagerly(f):
    # eagerly (n, min(3, n)) has two ragged axes; the compiled plan's second axis has the
    # fixed size 3 (it gave a Ragged of layout (N*, 3))
    step = _pair_step(f)
    x, _ = _batch([5, 6], 0)
    eager = step(x.values, x.offsets, x.sizes)
    assert eager.num_ragged == 2
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    for n, lengths in enumerate([[5, 6], [3, 4, 7], [4, 3]]):
        x, samples = _batch(lengths, n)
        got = compiled(x.values, x.offsets, x.sizes)
        assert isinstance(got, raggedfn.Ragged) and got.layout == eager.layout
        assert_restacked(got, [f(s) for s in samples])
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_compiled_map_refuses_a_fixed_axis_before_a_ragged_one():
    # (min(3, n), n): the fixed axis comes first, so a packed row is not a run of rows
    step = _pair_step(_scores_of_the_first_three)
    x, samples = _batch([5, 6], 0)
    eager = step(x.values, x.offsets, x.sizes)
    assert eager.num_ragged == 2
    assert_restacked(eager, [_scores_of_the_first_three(s) for s in samples])
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"inside torch\.compile, an output of f has ragged axes"):
        compiled(x.values, x.offsets, x.sizes)
