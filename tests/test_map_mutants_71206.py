"""``raggedfn.map`` behaviour that ``make mutate`` (seed 71206, the ``map`` slice) found
untested (docs/testing.md).

Each test compares ``map`` with the per-sample loop or asserts how the call ran
(``map_report``, a spied path); each was seen failing with its surviving mutant applied.
"""

from __future__ import annotations

import warnings

import torch

import raggedfn
from property_tests.reference import assert_same

D = 4


def _documents() -> raggedfn.Ragged:
    """Tokens per sentence of every document: a nested value ``(B, S*, L*, D)`` with an
    empty document and an empty sentence."""
    shape = [[2, 3], [], [1], [0, 4, 2], [3]]
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(sum(map(sum, shape)), D, generator=gen, dtype=torch.float64)
    rows = [n for doc in shape for n in doc]
    return raggedfn.from_nested_lengths(values, [[len(d) for d in shape], rows])


@torch.library.custom_op("raggedfn_test_mutants::triple_no_fake", mutates_args=())
def _triple_no_fake(t: torch.Tensor) -> torch.Tensor:
    """An op with no fake implementation: it runs eagerly and cannot be traced."""
    return t * 3


def test_a_segment_that_cannot_be_traced_says_why_in_the_nested_report():
    # the torch code between raggedfn ops (one segment) runs through one-level map, whose
    # trace fails on the op with no fake implementation: that segment runs per sample and
    # the nested report names it with the trace's reason
    x = _documents()

    def f(doc):
        return _triple_no_fake(torch.tanh(raggedfn.sum(doc, 1)))

    report = raggedfn.map_report(f, x)
    assert report.whole_loop is None and not report.fully_batched
    where = "segment 0 of torch code on per-sample tensors"
    assert list(report.fallback) == [where], report.fallback
    why = report.fallback[where]
    assert isinstance(why, str) and why.startswith("tracing failed") and "fake" in why, why
    assert_same(report.output, [f(x[i]) for i in range(x.batch_size)])


def test_a_per_sample_shape_passed_to_torch_is_named_in_the_reason():
    # torch.zeros(s.shape) with s's rows following the sample: the record stops and the
    # report says which torch function was handed the shape
    x = _documents()

    def f(doc):
        return torch.zeros(raggedfn.sum(doc, 1).shape)

    report = raggedfn.map_report(f, x)
    assert report.whole_loop is not None
    assert "f passes a per-sample shape to" in report.whole_loop, report.whole_loop
    assert "zeros" in report.whole_loop, report.whole_loop
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", raggedfn.RaggedPerformanceWarning)
        got = raggedfn.map(f, x)
    assert_same(got, [f(x[i]) for i in range(x.batch_size)])
