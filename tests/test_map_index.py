"""Batching rules Hugging Face models need: gather with per-sample positions, slices of
a shared buffer by the sample's length, addmm (Conv1D) and grouped-query attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import raggedfn
from property_tests.reference import assert_same, loop
from tests.test_map import D, tokens, weights

BUFFER = torch.arange(64).reshape(1, 64) * 10
TABLE = weights(64, D, seed=20)
RELATIVE = weights(D, 12, seed=25)


@pytest.mark.parametrize(
    "f",
    [
        lambda t: BUFFER[:, : t.shape[0]],  # HF's position_ids buffer
        lambda t: BUFFER[:, 2 : t.shape[0] + 2] * 2,
        lambda t: BUFFER[0, : t.shape[0] // 2],
        lambda t: TABLE[: t.shape[0]] + t,
        lambda t: torch.gather(t, 0, torch.argsort(t, 0)),  # ragged source, ragged axis
        lambda t: torch.gather(t, 1, torch.argsort(t, 1)[:, :3]),  # along a dense axis
        lambda t: torch.gather(TABLE, 0, torch.arange(t.shape[0])[:, None].expand(-1, D)),
        lambda t: torch.gather(
            BUFFER[:, : t.shape[0]], 1, t.shape[0] - 1 - torch.arange(t.shape[0])[None]
        ),  # HF's token types: a sliced buffer gathered by positions
        lambda t: torch.take_along_dim(t, torch.argsort(t, 0), 0),
    ],
)
def test_gather_and_shared_slices_equal_the_loop(f):
    x = tokens((3, 0, 5, 1))
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


def test_gather_out_of_range_raises_naming_the_sample():
    x = tokens((3, 5))
    with pytest.raises(RuntimeError, match="index 3 is out of bounds") as error:
        raggedfn.map(lambda t: torch.gather(t, 0, torch.full_like(t, 3).long()), x)
    assert error.value.__notes__ == ["raggedfn.map: raised by f for sample 0"]


@pytest.mark.parametrize(
    ("index", "sample"),
    [
        (lambda n: (torch.arange(n) // 3 * 9)[:, None].expand(-1, D), 1),
        (lambda n: torch.full((1, 1), 9).expand(n, D), 0),  # the same in every row
    ],
)
def test_gather_with_an_index_expanded_over_an_axis_checks_its_range(index, sample):
    """An index broadcast over a dense axis (stride 0) is checked once per distinct
    element; the loop then raises torch's own error, noted with the first sample out of range."""
    x = tokens((3, 5))
    with pytest.raises(RuntimeError, match="index 9 is out of bounds for dimension 1") as error:
        raggedfn.map(lambda t: torch.gather(t, 1, index(t.shape[0])), x)
    assert error.value.__notes__ == [f"raggedfn.map: raised by f for sample {sample}"]


def test_gather_gradients_equal_the_loop():
    x = tokens((3, 0, 4))
    values = x.values.clone().requires_grad_()
    xv = x.with_values(values)
    f = lambda t: torch.gather(t, 0, torch.argsort(t, 0)).cumsum(0)  # noqa: E731
    got = torch.autograd.grad(raggedfn.map(f, xv).values.pow(2).sum(), values)[0]
    want = torch.autograd.grad(sum(o.pow(2).sum() for o in loop(f, xv)), values)[0]
    torch.testing.assert_close(got, want)


def relative_gather(t):
    """DeBERTa's content -> position term: a per-token row over relative buckets
    ([H, n, span], its dense axes stored permuted: not contiguous) read at each (query, key)
    pair's clamped relative position: a pair state gathered along a dense axis."""
    n = t.shape[0]
    rows = (t @ RELATIVE).view(n, 6, 2).permute(2, 0, 1)  # [2, n, 6]
    rel = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    index = (rel + 3).clamp(0, 5)[None].expand(2, n, n)
    return torch.gather(rows, -1, index).sum(0)


def test_relative_position_gather_of_a_pair_state_equals_the_loop_with_gradients():
    x = tokens((3, 0, 5, 1, 6))
    values = x.values.clone().requires_grad_()
    report = raggedfn.map_report(relative_gather, x.with_values(values))
    assert report.fully_batched, str(report)
    want = loop(relative_gather, x.with_values(values))
    assert_same(report.output, want)
    weights_ = torch.linspace(-1, 1, report.output.values.numel(), dtype=values.dtype)
    got = torch.autograd.grad((report.output.values.flatten() * weights_).sum(), values)[0]
    flat = torch.cat([w.flatten() for w in want])
    expected = torch.autograd.grad((flat * weights_).sum(), values)[0]
    torch.testing.assert_close(got, expected)


def test_addmm_of_per_sample_rows():
    w, b = weights(D, 5, seed=21), weights(5, seed=22)
    x = tokens((3, 0, 2))
    f = lambda t: torch.addmm(b, t, w, beta=0.5, alpha=2.0).relu()  # noqa: E731
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


def test_grouped_query_attention_equals_the_loop():
    wq, wk = weights(4 * 2, D, seed=23), weights(2 * 2, D, seed=24)

    def f(t):
        q = (t @ wq.T).reshape(t.shape[0], 4, 2).transpose(0, 1)[None]
        k = (t @ wk.T).reshape(t.shape[0], 2, 2).transpose(0, 1)[None]
        return F.scaled_dot_product_attention(q, k, k, enable_gqa=True, is_causal=True)[0]

    x = tokens((3, 1, 5))
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


@pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)
def test_relative_position_gather_compiles_without_a_graph_break():
    layout = raggedfn.Layout.standard(1, 1)

    def step(values, offsets, sizes):
        x = raggedfn.Ragged(values, offsets, sizes, layout)
        return raggedfn.map(relative_gather, x).values

    first = tokens((3, 2, 5))
    step(first.values, first.offsets, first.sizes)  # traces f eagerly
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for lengths in ((3, 2, 5, 1, 6), (4, 2, 7)):
        x = tokens(lengths)
        per = [relative_gather(s).flatten() for s in x.values.split(x.lengths.tolist())]
        want = torch.cat(per)  # [n, n] pair states, packed row-major
        torch.testing.assert_close(compiled(x.values, x.offsets, x.sizes), want)
