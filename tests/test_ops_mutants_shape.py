"""Ops behaviour that ``make mutate`` found untested (elementwise alignment, sort).

Each test compares with torch run on every sample alone (or the error it must raise)
and was seen failing with the surviving mutant applied by hand.
"""

from __future__ import annotations

import pytest
import torch

import raggedfn
from property_tests.reference import assert_same, loop
from raggedfn import RaggedError


def test_adding_same_partition_values_traced_on_fake_tensors_keeps_one_row_count() -> None:
    # make_fx with fake tensors (how torch.compile and torch.export trace, no dynamo): two
    # operands with equal (not identical) partitions; the alignment tells the tracer that
    # their row counts agree (kills x_align__mutmut_189: ``values.shape[0] != total``
    # makes torch._check fail while tracing); the graph adds every sample
    from torch.fx.experimental.proxy_tensor import make_fx

    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 3, generator=gen) for n in (2, 0, 3)]
    ys = [torch.randn(n, 3, generator=gen) for n in (2, 0, 3)]
    x, y = raggedfn.from_list(xs), raggedfn.from_list(ys)

    def run(*parts: torch.Tensor) -> torch.Tensor:
        xv, xo, xs_, yv, yo, ys_ = parts
        xx = raggedfn.Ragged(xv, xo, xs_, x.layout)
        yy = raggedfn.Ragged(yv, yo, ys_, y.layout)
        return (xx + yy).values

    parts = [x.values, x.offsets, x.sizes, y.values, y.offsets.clone(), y.sizes.clone()]
    graph = make_fx(run, tracing_mode="fake")(*parts)
    got = raggedfn.from_offsets(graph(*parts), x.offsets)
    assert_same(got, loop(torch.add, x, y))


def test_a_sentence_value_with_inconsistent_offsets_is_refused_against_nested_tokens() -> None:
    # sentence features (B, S*, 1, D) against tokens (B, S*, T*, D): the same sizes but
    # offsets (built with the unchecked dataclass constructor) that do not match the
    # sentence level are named in the error (kills x__nested_prefix_rows__mutmut_61,
    # which names ``None`` instead of ``offsets``)
    gen = torch.Generator().manual_seed(0)
    docs = [[torch.randn(n, 2, generator=gen) for n in doc] for doc in ([2, 1], [3])]
    tokens = raggedfn.from_list(docs)
    feats = raggedfn.from_list(
        [torch.randn(2, 1, 2, generator=gen), torch.randn(1, 1, 2, generator=gen)],
        ragged_dims=(1,),
    )
    # the consistent value broadcasts over every sentence's tokens, as torch per sentence
    out = tokens + feats
    want = [
        torch.cat([t + f[j] for j, t in enumerate(doc)])
        for doc, f in zip(docs, raggedfn.unbind(feats), strict=True)
    ]
    assert torch.equal(out.values, torch.cat(want))
    bad = raggedfn.Ragged(feats.values, torch.tensor([0, 1, 3]), feats.sizes, feats.layout)
    with pytest.raises(
        RaggedError, match=r"^add: operands have different partitions: offsets \[0, 1, 3\]"
    ):
        tokens + bad


def test_sort_errors_name_sort() -> None:
    # kills x_sort__mutmut_2: errors of sort are prefixed by "sort", not "None"
    x = raggedfn.from_list([torch.tensor([1 + 1j, 2j]), torch.tensor([3 + 0j])])
    with pytest.raises(RaggedError, match=r"^sort: "):
        raggedfn.sort(x, 1)
    y = raggedfn.from_list([torch.tensor([3.0, 1.0]), torch.tensor([2.0])])
    with pytest.raises(RaggedError, match=r"^sort: "):
        raggedfn.sort(y, 5)
    values, indices = raggedfn.sort(y, 1)
    assert_same(values, loop(lambda t: torch.sort(t, dim=0, stable=True).values, y))
    assert_same(indices, loop(lambda t: torch.sort(t, dim=0, stable=True).indices, y))
